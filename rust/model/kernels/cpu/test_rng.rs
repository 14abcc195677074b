//! What the crate's kernel tests share: deterministic random numbers (`crate::rng`: a failure
//! reproduces from its seed), and thread pools of given sizes for invariance checks.

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
