//! Identifiers: a type prefix (docs/api.md) and 24 random base62 characters
//! (~143 bits), so ids never collide and reveal nothing about volume.

use rand::Rng;

const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
pub const ID_RANDOM_CHARS: usize = 24;
/// API keys carry more randomness (~190 bits).
pub const API_KEY_RANDOM_CHARS: usize = 32;

pub fn random_base62(chars: usize) -> String {
    let mut rng = rand::rng();
    (0..chars)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", random_base62(ID_RANDOM_CHARS))
}

/// `chars` base62 characters derived from secret `seed` bytes (SHA-256 of the seed
/// and a block counter): as hard to guess as the seed, the same for the same seed.
pub fn derived_base62(seed: &[u8], chars: usize) -> String {
    use sha2::{Digest, Sha256};
    let mut out = String::with_capacity(chars);
    let mut block = 0u32;
    while out.len() < chars {
        let digest = Sha256::new()
            .chain_update(seed)
            .chain_update(block.to_le_bytes())
            .finalize();
        // Bytes at or past the largest multiple of 62 are skipped: no bias.
        for byte in digest.iter().filter(|b| **b < 248) {
            if out.len() == chars {
                break;
            }
            out.push(ALPHABET[*byte as usize % ALPHABET.len()] as char);
        }
        block = block.wrapping_add(1);
    }
    out
}

/// An id apply derives from what it applies (`seed`), so a replay derives the same
/// one: the prefix and 24 base62 characters of the seed's SHA-256, like a random id.
pub fn derived_id(prefix: &str, seed: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(seed.as_bytes());
    let chars: String = digest
        .iter()
        .take(ID_RANDOM_CHARS)
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect();
    format!("{prefix}_{chars}")
}
