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
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
