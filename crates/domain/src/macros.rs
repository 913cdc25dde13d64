//! Macros the domain's modules share.

/// An enum of the wire with its names: `as_str`, `parse`, `ALL` and the message
/// that lists the allowed values.
macro_rules! wire_enum {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            pub fn parse(text: &str) -> Option<$name> {
                $name::ALL.iter().copied().find(|v| v.as_str() == text)
            }

            /// Parses the value of field `param`, naming the allowed values on error.
            pub fn parse_field(param: &str, text: &str) -> Result<$name, FieldError> {
                $name::parse(text).ok_or_else(|| {
                    let allowed: Vec<&str> = $name::ALL.iter().map(|v| v.as_str()).collect();
                    FieldError::invalid(
                        param,
                        format!("`{param}` must be one of {}", allowed.join(", ")),
                    )
                })
            }
        }
    };
}
