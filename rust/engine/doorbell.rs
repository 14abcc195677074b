//! `Doorbell`: a waker that wakes an event loop through an eventfd, once per batch of wake-ups.
//!
//! The stream bindings register one doorbell per asyncio event loop as the waker of every
//! channel that loop waits on; the loop watches the eventfd and, when it fires, polls its waiting
//! streams (`rust/python/dispatch.rs`). A ring writes to the eventfd only when no ring is
//! outstanding, so a step that feeds 64 streams of one loop costs one write and one wake-up.
//!
//! Why an eventfd and not a socket pair or a pipe: those wake their reader "synchronously", a
//! hint that makes Linux run the woken event loop on the engine thread's core, pre-empting the
//! engine even with a core free (docs/benchmarks.md, "Figures behind code comments"). An
//! eventfd wakes it like any other thread.
//!
//! A thread that sends a batch of events (a step's deltas, `engine::core::send_all`) wraps the
//! sends in [`deferring_rings`]: the wake-ups those sends cause ring once each at the end of the
//! batch instead of at the first send. Without it the first send wakes the loop, which drains
//! while the others are still being sent and is woken again for them (measured: 3.4 chunks per
//! wake-up with 8 streams instead of 8), and every wake-up costs the loop's thread its own
//! machinery (on trio a task switch and an `epoll_ctl` besides the `epoll_wait`).

use std::cell::RefCell;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::task::Wake;

thread_local! {
    /// The doorbells woken on this thread inside [`deferring_rings`], rung when it ends; `None`
    /// outside it.
    static DEFERRED: RefCell<Option<Vec<Arc<Doorbell>>>> = const { RefCell::new(None) };
}

/// Runs `f`, holding back the rings of every doorbell woken (as a waker) on this thread until
/// it returns, then ringing each once. Also rings them when `f` panics. Nested calls join the
/// outer one.
pub fn deferring_rings<R>(f: impl FnOnce() -> R) -> R {
    struct RingOnExit;
    impl Drop for RingOnExit {
        fn drop(&mut self) {
            let held = DEFERRED
                .try_with(|d| d.try_borrow_mut().ok().and_then(|mut d| d.take()))
                .ok()
                .flatten()
                .unwrap_or_default();
            for doorbell in held {
                doorbell.ring();
            }
        }
    }
    let outer = DEFERRED.with(|d| {
        let mut d = d.borrow_mut();
        let outer = d.is_some();
        if !outer {
            *d = Some(Vec::new());
        }
        outer
    });
    if outer {
        return f();
    }
    let _ring = RingOnExit;
    f()
}

/// Rings `doorbell` now, or at the end of the [`deferring_rings`] this thread is in.
fn ring_or_defer(doorbell: &Arc<Doorbell>) {
    // `try_with`: a waker may run while this thread's locals are torn down (a channel dropped
    // at thread exit); it then rings at once.
    let deferred = DEFERRED.try_with(|d| match d.try_borrow_mut() {
        Ok(mut d) => match d.as_mut() {
            Some(held) => {
                if !held.iter().any(|h| Arc::ptr_eq(h, doorbell)) {
                    held.push(doorbell.clone());
                }
                true
            }
            None => false,
        },
        // Woken from inside the list's own handling (cannot happen: ringing wakes no waker);
        // ringing at once is always correct.
        Err(_) => false,
    });
    if !matches!(deferred, Ok(true)) {
        doorbell.ring();
    }
}

pub struct Doorbell {
    eventfd: File,
    /// A ring is outstanding: the eventfd was written and the reader has not reset it yet.
    rung: AtomicBool,
}

impl Doorbell {
    pub fn new() -> std::io::Result<Doorbell> {
        // SAFETY: eventfd has no memory arguments; the descriptor it returns is owned here only.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let eventfd = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(Doorbell {
            eventfd,
            rung: AtomicBool::new(false),
        })
    }

    /// The descriptor the event loop watches for reading.
    pub fn fd(&self) -> RawFd {
        self.eventfd.as_raw_fd()
    }

    /// Wakes the reader unless a wake-up is already on its way.
    pub fn ring(&self) {
        if !self.rung.swap(true, SeqCst) {
            // Non-blocking; the counter cannot overflow with one ring outstanding. A failure
            // here would leave the loop asleep, so it is logged, not ignored.
            if let Err(e) = (&self.eventfd).write(&1u64.to_ne_bytes()) {
                log::error!("stream wake-up failed: {e}");
            }
        }
    }

    /// Called by the reader when the eventfd fires, before it polls what it waits on: a ring that
    /// comes during or after this call is either seen by those polls or wakes the reader again.
    pub fn reset(&self) {
        self.reset_with(|| {});
    }

    /// `reset`, running `between` after the counter is read and before the flag is cleared (for
    /// the test of the race that order avoids).
    fn reset_with(&self, between: impl FnOnce()) {
        // The counter is read first and the flag cleared after. The other order loses a ring
        // that lands between the two: it is read away here, its flag stays set, and no ring
        // writes again. That hung a benchmark after a few thousand steps.
        let _ = (&self.eventfd).read(&mut [0u8; 8]);
        between();
        self.rung.store(false, SeqCst);
    }

    /// A ring is waiting to be read (for tests).
    #[cfg(test)]
    fn readable(&self) -> bool {
        let mut buf = [0u8; 8];
        // An eventfd reads and writes its counter as exactly 8 bytes.
        if (&self.eventfd).read_exact(&mut buf).is_err() {
            return false;
        }
        // Put it back as it was.
        (&self.eventfd).write_all(&buf).is_ok()
    }
}

impl Wake for Doorbell {
    fn wake(self: Arc<Self>) {
        ring_or_defer(&self);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        ring_or_defer(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_write_once_until_reset() {
        let d = Doorbell::new().unwrap();
        assert!(!d.readable());
        d.ring();
        d.ring();
        assert!(d.readable());
        d.reset();
        assert!(!d.readable());
        d.ring();
        assert!(d.readable());
    }

    #[test]
    fn a_ring_during_reset_is_not_lost() {
        let d = Doorbell::new().unwrap();
        d.ring();
        // The engine rings while the reader resets: the reader's polls after reset see its
        // event, and the next ring must wake the reader again.
        d.reset_with(|| d.ring());
        d.ring();
        assert!(d.readable(), "a ring after reset did not wake the reader");
    }

    #[test]
    fn wakers_ring_it() {
        let d = Arc::new(Doorbell::new().unwrap());
        let waker = std::task::Waker::from(d.clone());
        waker.wake_by_ref();
        assert!(d.readable());
        d.reset();
        waker.wake();
        assert!(d.readable());
    }

    #[test]
    fn deferred_rings_ring_once_at_the_end() {
        let (a, b) = (
            Arc::new(Doorbell::new().unwrap()),
            Arc::new(Doorbell::new().unwrap()),
        );
        let (wa, wb) = (
            std::task::Waker::from(a.clone()),
            std::task::Waker::from(b.clone()),
        );
        deferring_rings(|| {
            wa.wake_by_ref();
            wb.wake_by_ref();
            deferring_rings(|| wa.wake_by_ref());
            assert!(!a.readable() && !b.readable(), "rang inside the batch");
        });
        assert!(a.readable() && b.readable());
        a.reset();
        b.reset();
        // Outside a batch, a wake rings at once.
        wa.wake_by_ref();
        assert!(a.readable());
    }

    #[test]
    fn deferred_rings_ring_when_the_batch_panics() {
        let d = Arc::new(Doorbell::new().unwrap());
        let waker = std::task::Waker::from(d.clone());
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            deferring_rings(|| {
                waker.wake_by_ref();
                panic!("a send panicked");
            })
        }));
        assert!(caught.is_err());
        assert!(d.readable(), "the held ring was lost");
    }
}
