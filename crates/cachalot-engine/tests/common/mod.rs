//! Helpers shared by the engine's integration tests.

/// Deterministic pseudo-random prompts of the given lengths (ids 2.., avoiding BOS/EOS).
pub fn prompts(lens: &[usize], vocab: usize) -> Vec<Vec<u32>> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    lens.iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    2 + ((state >> 33) as usize % (vocab - 2)) as u32
                })
                .collect()
        })
        .collect()
}
