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
//!
//! Off Linux (macOS, the BSDs) there is no eventfd and no such hint: the doorbell is a
//! non-blocking pipe instead, whose read end the loop watches. It keeps the same contract: a
//! ring writes one byte only when no ring is outstanding, and `reset` drains the pipe before it
//! clears the flag, so the pipe never holds more than one byte. Linux builds keep the eventfd;
//! the pipe is compiled there for its tests only.

use std::cell::RefCell;
use std::fs::File;
use std::io::{Read, Write};
#[cfg(target_os = "linux")]
use std::os::fd::FromRawFd;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
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

/// What the reader's descriptor is: an eventfd on Linux, a pipe elsewhere.
enum Signal {
    /// Reads and writes its counter as exactly 8 bytes.
    #[cfg(target_os = "linux")]
    EventFd(File),
    /// Both ends non-blocking and close-on-exec; the loop watches `read`.
    #[cfg(any(test, not(target_os = "linux")))]
    Pipe { read: File, write: File },
}

pub struct Doorbell {
    signal: Signal,
    /// A ring is outstanding: the descriptor was written and the reader has not reset it yet.
    rung: AtomicBool,
}

impl Doorbell {
    /// An eventfd on Linux, a non-blocking pipe on other Unix systems.
    pub fn new() -> std::io::Result<Doorbell> {
        #[cfg(target_os = "linux")]
        {
            Doorbell::with_eventfd()
        }
        #[cfg(not(target_os = "linux"))]
        {
            Doorbell::with_pipe()
        }
    }

    #[cfg(target_os = "linux")]
    fn with_eventfd() -> std::io::Result<Doorbell> {
        // SAFETY: eventfd has no memory arguments; the descriptor it returns is owned here only.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let eventfd = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(Doorbell::with_signal(Signal::EventFd(eventfd)))
    }

    /// The portable doorbell: a pipe (std's `io::pipe`, close-on-exec), both ends made
    /// non-blocking, so that a ring never blocks the engine and `reset` stops when it is empty.
    #[cfg(any(test, not(target_os = "linux")))]
    fn with_pipe() -> std::io::Result<Doorbell> {
        let (read, write) = std::io::pipe()?;
        let (read, write) = (
            File::from(OwnedFd::from(read)),
            File::from(OwnedFd::from(write)),
        );
        set_nonblocking(&read)?;
        set_nonblocking(&write)?;
        Ok(Doorbell::with_signal(Signal::Pipe { read, write }))
    }

    fn with_signal(signal: Signal) -> Doorbell {
        Doorbell {
            signal,
            rung: AtomicBool::new(false),
        }
    }

    /// The descriptor the event loop watches for reading.
    pub fn fd(&self) -> RawFd {
        match &self.signal {
            #[cfg(target_os = "linux")]
            Signal::EventFd(f) => f.as_raw_fd(),
            #[cfg(any(test, not(target_os = "linux")))]
            Signal::Pipe { read, .. } => read.as_raw_fd(),
        }
    }

    /// Wakes the reader unless a wake-up is already on its way.
    pub fn ring(&self) {
        if !self.rung.swap(true, SeqCst) {
            // Non-blocking; with one ring outstanding the eventfd's counter cannot overflow and
            // the pipe holds one byte. A failure here would leave the loop asleep, so it is
            // logged, not ignored.
            let written = match &self.signal {
                #[cfg(target_os = "linux")]
                Signal::EventFd(f) => (&*f).write(&1u64.to_ne_bytes()),
                #[cfg(any(test, not(target_os = "linux")))]
                Signal::Pipe { write, .. } => (&*write).write(&[1u8]),
            };
            if let Err(e) = written {
                log::error!("stream wake-up failed: {e}");
            }
        }
    }

    /// Called by the reader when the descriptor fires, before it polls what it waits on: a ring
    /// that comes during or after this call is either seen by those polls or wakes the reader
    /// again.
    pub fn reset(&self) {
        self.reset_with(|| {});
    }

    /// `reset`, running `between` after the descriptor is read and before the flag is cleared
    /// (for the test of the race that order avoids).
    fn reset_with(&self, between: impl FnOnce()) {
        // The descriptor is read first and the flag cleared after. The other order loses a ring
        // that lands between the two: it is read away here, its flag stays set, and no ring
        // writes again. That hung a benchmark after a few thousand steps.
        match &self.signal {
            #[cfg(target_os = "linux")]
            Signal::EventFd(f) => {
                let _ = (&*f).read(&mut [0u8; 8]);
            }
            #[cfg(any(test, not(target_os = "linux")))]
            Signal::Pipe { read, .. } => {
                // Until empty (WouldBlock) or failing; it holds one byte at most, the loop is
                // for safety. EOF cannot come: the write end lives as long as this.
                let mut buf = [0u8; 64];
                while matches!((&*read).read(&mut buf), Ok(n) if n > 0) {}
            }
        }
        between();
        self.rung.store(false, SeqCst);
    }

    /// A ring is waiting to be read (for tests): the descriptor polls readable, without reading
    /// it.
    #[cfg(test)]
    fn readable(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; a zero timeout only asks.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n == 1 && p.revents & libc::POLLIN != 0
    }
}

/// Sets O_NONBLOCK on `f`'s descriptor.
#[cfg(any(test, not(target_os = "linux")))]
fn set_nonblocking(f: &File) -> std::io::Result<()> {
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a descriptor `f` owns, with no memory arguments.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
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
// Off Linux every doorbell is a pipe, so matching one is irrefutable there.
#[cfg_attr(not(target_os = "linux"), allow(irrefutable_let_patterns))]
mod tests {
    use super::*;

    /// The platform's doorbell and the pipe one (the same on other systems): every test runs on
    /// both.
    type Make = fn() -> std::io::Result<Doorbell>;
    const KINDS: [(&str, Make); 2] = [("new", Doorbell::new), ("pipe", Doorbell::with_pipe)];

    #[test]
    fn rings_write_once_until_reset() {
        for (kind, make) in KINDS {
            let d = make().unwrap();
            assert!(!d.readable(), "{kind}");
            d.ring();
            d.ring();
            assert!(d.readable(), "{kind}");
            d.reset();
            assert!(!d.readable(), "{kind}");
            d.ring();
            assert!(d.readable(), "{kind}");
        }
    }

    #[test]
    fn a_ring_during_reset_is_not_lost() {
        for (kind, make) in KINDS {
            let d = make().unwrap();
            d.ring();
            // The engine rings while the reader resets: the reader's polls after reset see its
            // event, and the next ring must wake the reader again.
            d.reset_with(|| d.ring());
            d.ring();
            assert!(
                d.readable(),
                "{kind}: a ring after reset did not wake the reader"
            );
        }
    }

    #[test]
    fn wakers_ring_it() {
        for (kind, make) in KINDS {
            let d = Arc::new(make().unwrap());
            let waker = std::task::Waker::from(d.clone());
            waker.wake_by_ref();
            assert!(d.readable(), "{kind}");
            d.reset();
            waker.wake();
            assert!(d.readable(), "{kind}");
        }
    }

    #[test]
    fn deferred_rings_ring_once_at_the_end() {
        for (kind, make) in KINDS {
            let (a, b) = (Arc::new(make().unwrap()), Arc::new(make().unwrap()));
            let (wa, wb) = (
                std::task::Waker::from(a.clone()),
                std::task::Waker::from(b.clone()),
            );
            deferring_rings(|| {
                wa.wake_by_ref();
                wb.wake_by_ref();
                deferring_rings(|| wa.wake_by_ref());
                assert!(
                    !a.readable() && !b.readable(),
                    "{kind}: rang inside the batch"
                );
            });
            assert!(a.readable() && b.readable(), "{kind}");
            a.reset();
            b.reset();
            // Outside a batch, a wake rings at once.
            wa.wake_by_ref();
            assert!(a.readable(), "{kind}");
        }
    }

    #[test]
    fn deferred_rings_ring_when_the_batch_panics() {
        for (kind, make) in KINDS {
            let d = Arc::new(make().unwrap());
            let waker = std::task::Waker::from(d.clone());
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                deferring_rings(|| {
                    waker.wake_by_ref();
                    panic!("a send panicked");
                })
            }));
            assert!(caught.is_err());
            assert!(d.readable(), "{kind}: the held ring was lost");
        }
    }

    /// What the pipe holds now, read away (non-blocking: stops when it is empty).
    fn pipe_bytes(d: &Doorbell) -> usize {
        let Signal::Pipe { read, .. } = &d.signal else {
            panic!("not a pipe doorbell");
        };
        let mut buf = [0u8; 256];
        let mut total = 0;
        loop {
            match (&*read).read(&mut buf) {
                Ok(0) => return total,
                Ok(n) => total += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return total,
                Err(e) => panic!("reading the pipe: {e}"),
            }
        }
    }

    #[test]
    fn the_pipe_holds_one_byte_per_batch_and_reset_drains_it() {
        let d = Arc::new(Doorbell::with_pipe().unwrap());
        let Signal::Pipe { read, write } = &d.signal else {
            panic!("not a pipe doorbell");
        };
        // The loop watches the read end.
        assert_eq!(d.fd(), read.as_raw_fd());
        assert_ne!(d.fd(), write.as_raw_fd());
        let waker = std::task::Waker::from(d.clone());
        for _ in 0..100 {
            d.ring();
        }
        deferring_rings(|| {
            for _ in 0..64 {
                waker.wake_by_ref();
            }
        });
        assert_eq!(
            pipe_bytes(&d),
            1,
            "100 rings and a batch of 64 wake-ups: one byte"
        );
        // The byte is gone but no reset came: the ring is still outstanding, nothing writes.
        d.ring();
        assert_eq!(pipe_bytes(&d), 0);
        d.reset();
        // A batch after the reset rings once more, and reset drains it.
        deferring_rings(|| {
            for _ in 0..64 {
                waker.wake_by_ref();
            }
        });
        assert!(d.readable());
        d.reset();
        assert!(!d.readable());
        assert_eq!(pipe_bytes(&d), 0);
        // A reset with nothing to read (a spurious wake-up) does not block.
        d.reset();
        d.ring();
        assert_eq!(pipe_bytes(&d), 1);
    }
}
