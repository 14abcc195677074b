//! Small synchronisation helpers shared by the core and the bindings.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, also after a panic elsewhere poisoned it: the data behind our mutexes (queues,
/// lists, counters) stays whole when a holder panics, so it is still usable.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
