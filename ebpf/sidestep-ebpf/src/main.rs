//! sidestep's BPF programs. One module per program family; shared lookups live in `policy`.
#![no_std]
#![no_main]

mod ambient;
mod connect;
mod context;
mod debuglog;
mod dns;
mod inbound;
mod maps;
mod packet;
mod peername;
mod policy;
mod portguard;
mod reroute;
mod routeguard;
mod sklookup;
mod skmsg;
mod sockops;
mod sockopt;
mod sourceroute;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier proves no panic path is reachable; this only satisfies the no_std contract.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
