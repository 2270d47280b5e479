//! Context-field access. The verifier accepts only 4-byte loads and stores on these fields, and
//! LLVM merges adjacent plain accesses into 8-byte ones, so every access goes through volatile.

use core::ptr::{read_volatile, write_volatile};

/// Reads a 4-byte context field.
///
/// # Safety
/// `field` must point into a live BPF context.
#[inline(always)]
pub unsafe fn load<T: Copy>(field: *const T) -> T {
    // SAFETY: the caller guarantees `field` is a valid context field.
    unsafe { read_volatile(field) }
}

/// Writes a 4-byte context field.
///
/// # Safety
/// `field` must point into a live BPF context and be writable for this program type.
#[inline(always)]
pub unsafe fn store<T: Copy>(field: *mut T, value: T) {
    // SAFETY: the caller guarantees `field` is a valid, writable context field.
    unsafe { write_volatile(field, value) }
}

/// Reads an address held as four 4-byte words, one word at a time.
///
/// # Safety
/// `words` must point into a live BPF context.
#[inline(always)]
pub unsafe fn load_ip6(words: *const [u32; 4]) -> [u32; 4] {
    let base = words.cast::<u32>();
    // SAFETY: each word lies inside the field the caller vouched for.
    unsafe {
        [
            read_volatile(base),
            read_volatile(base.add(1)),
            read_volatile(base.add(2)),
            read_volatile(base.add(3)),
        ]
    }
}

/// Writes an address held as four 4-byte words, one word at a time.
///
/// # Safety
/// `words` must point into a live, writable BPF context field.
#[inline(always)]
pub unsafe fn store_ip6(words: *mut [u32; 4], value: [u32; 4]) {
    let base = words.cast::<u32>();
    // SAFETY: each word lies inside the field the caller vouched for.
    unsafe {
        write_volatile(base, value[0]);
        write_volatile(base.add(1), value[1]);
        write_volatile(base.add(2), value[2]);
        write_volatile(base.add(3), value[3]);
    }
}
