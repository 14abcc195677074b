//! `Rng`: deterministic pseudo-random numbers (xorshift64) for what must repeat from a seed:
//! the tests' inputs, the benches' token ids, synthetic models' weights and the fault injector's
//! `P%` draws. Not for sampling (the sampler has its own seeded generator, `engine::sampler`).

/// xorshift64 over its state, which must not be 0.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [0, 1), 24 bits.
    pub fn unit(&mut self) -> f32 {
        (self.next_u() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-1, 1).
    pub fn signed(&mut self) -> f32 {
        self.unit() * 2.0 - 1.0
    }

    /// Uniform in [-1, 1).
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        self.scaled(n, 1.0)
    }

    /// Uniform in [-scale, scale).
    pub fn scaled(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.signed() * scale).collect()
    }

    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u() % n as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn the_sequence_is_xorshift64_from_the_seed() {
        // Marsaglia's xorshift64 (13, 7, 17) from 1: its first outputs, worked by hand.
        let mut r = Rng(1);
        assert_eq!(r.next_u(), 1082269761);
        assert_eq!(r.next_u(), 1152992998833853505);
        let mut a = Rng(42);
        let mut b = Rng(42);
        assert_eq!(a.vec(8), b.vec(8));
        assert!(Rng(7)
            .scaled(1000, 0.5)
            .iter()
            .all(|x| (-0.5..0.5).contains(x)));
    }
}
