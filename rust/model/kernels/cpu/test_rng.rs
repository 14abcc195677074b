//! What the crate's kernel tests share: deterministic random numbers (`crate::rng`: a failure
//! reproduces from its seed), thread pools of given sizes for invariance checks, and the
//! timing tests' best-of-N clock.

pub use crate::rng::Rng;

/// One rayon pool per thread count: a kernel's result must not depend on which one runs it.
pub fn thread_pools(counts: &[usize]) -> Vec<rayon::ThreadPool> {
    counts
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .expect("a test thread pool")
        })
        .collect()
}

/// The best of `reps` timed calls of `f` after one untimed call, in seconds: robust to other
/// processes on a shared machine.
pub fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = std::time::Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}
