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
