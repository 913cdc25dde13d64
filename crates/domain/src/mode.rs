//! The two isolated environments. Data of one never mixes with the other.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    Prod,
    Test,
}

impl Mode {
    /// The value of the `mode` field of API objects.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Prod => "prod",
            Mode::Test => "test",
        }
    }

    /// One byte used in projection keys so the environments never share a key range.
    pub fn key_byte(self) -> u8 {
        match self {
            Mode::Prod => b'p',
            Mode::Test => b't',
        }
    }

    /// The inverse of [`Mode::key_byte`]; `None` for any other byte (corrupt data,
    /// which callers stop on rather than guess).
    pub fn from_key_byte(byte: u8) -> Option<Mode> {
        [Mode::Prod, Mode::Test]
            .into_iter()
            .find(|mode| mode.key_byte() == byte)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_bytes_round_trip_and_nothing_else_decodes() {
        for mode in [Mode::Prod, Mode::Test] {
            assert_eq!(Mode::from_key_byte(mode.key_byte()), Some(mode));
        }
        let decoded = (0..=u8::MAX).filter_map(Mode::from_key_byte).count();
        assert_eq!(decoded, 2);
    }
}
