//! What the crate's tests share: deterministic random numbers (xorshift64: no rand crate, and a
//! failure reproduces from its seed), and thread pools of given sizes for invariance checks.

pub struct Rng(pub u64);

impl Rng {
    pub fn next_u(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    pub fn next(&mut self) -> f32 {
        ((self.next_u() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Uniform in [-1, 1).
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        self.scaled(n, 1.0)
    }

    /// Uniform in [-scale, scale).
    pub fn scaled(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }

    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u() % n as u64) as usize
    }
}

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
