//! Taking pinned BPF links away: detach what each pin holds, then remove the pin. Unload, a
//! pod's DEL and the agent's clean-up all end a link this way, so a pin that no longer opens (or
//! is no link) still goes.

use std::{fs, os::fd::AsFd as _, path::Path};

use crate::{error::LoadError, sys};

/// Detaches each pinned link below `dir` (recursively) and removes its pin.
pub fn detach_links_under(dir: &Path) -> Result<(), LoadError> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            detach_links_under(&path)?;
            continue;
        }
        // A pin that no longer opens (or is not a link) is still removed.
        if let Ok(link) = sys::obj_get(&path) {
            let _ = sys::link_detach(link.as_fd());
        }
        fs::remove_file(&path).map_err(|source| LoadError::Unpin {
            path: path.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Detaches the link pinned at `pin`, if it still is one, and removes the pin; errors are
/// ignored (the caller is cleaning up a pod that may be half gone).
pub fn detach_link(pin: &Path) {
    if let Ok(link) = sys::obj_get(pin) {
        let _ = sys::link_detach(link.as_fd());
    }
    let _ = fs::remove_file(pin);
}
