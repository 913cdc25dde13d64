//! Customers: the stored shape and the validation of create and update input
//! (docs/api.md, "Customers").

use std::collections::BTreeMap;

use crate::error::FieldError;
use crate::ids::{CustomerId, StoreId};
use crate::limits::{
    MAX_EMAIL_CHARS, MAX_EXTERNAL_ID_CHARS, MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS,
    MAX_METADATA_VALUE_CHARS, MAX_NAME_CHARS,
};
use crate::mode::Mode;

#[derive(Debug, Clone, PartialEq)]
pub struct Customer {
    pub id: CustomerId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub email: String,
    pub name: Option<String>,
    pub country: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub external_id: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// A field of an update: absent (keep), explicit null (clear), or a value.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Patch<T> {
    #[default]
    Keep,
    Clear,
    Set(T),
}

impl<T> Patch<T> {
    /// On a create: the value given, if any (`Keep` and `Clear` both mean none).
    pub fn into_option(self) -> Option<T> {
        match self {
            Patch::Set(value) => Some(value),
            Patch::Keep | Patch::Clear => None,
        }
    }

    /// On an update: the new value given `current`.
    pub fn apply_to(self, current: Option<T>) -> Option<T> {
        match self {
            Patch::Keep => current,
            Patch::Clear => None,
            Patch::Set(value) => Some(value),
        }
    }
}

/// Create or update input as the edge parsed it. On create, `Keep` means "not given".
#[derive(Debug, Clone, Default)]
pub struct CustomerInput {
    pub email: Patch<String>,
    pub name: Patch<String>,
    pub country: Patch<String>,
    pub metadata: Patch<BTreeMap<String, String>>,
    pub external_id: Patch<String>,
}

/// The validated values of a create or update.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CustomerChanges {
    pub email: Patch<String>,
    pub name: Patch<String>,
    pub country: Patch<String>,
    pub metadata: Patch<BTreeMap<String, String>>,
    pub external_id: Patch<String>,
}

/// A deliberately simple email check: one `@`, a non-empty local part, a domain with
/// a dot, no spaces and no control characters (a NUL or a line break in an address
/// would reach every webhook and export that prints it). Deliverability is the
/// caller's business.
pub fn is_valid_email(email: &str) -> bool {
    let Some((local, domain)) = email.split_once('@') else {
        return false;
    };
    !local.is_empty()
        && !domain.contains('@')
        && domain.contains('.')
        && !domain.starts_with('.')
        && !domain.ends_with('.')
        && !email.chars().any(|c| c.is_whitespace() || c.is_control())
        && email.chars().count() <= MAX_EMAIL_CHARS
}

/// `external_id`: trimmed, letters/digits/`_`/`-`, 1..255 characters (docs/api.md).
pub fn normalize_external_id(raw: &str) -> Result<String, FieldError> {
    let trimmed = raw.trim();
    if trimmed.is_empty() || trimmed.chars().count() > MAX_EXTERNAL_ID_CHARS {
        return Err(FieldError::invalid(
            "external_id",
            format!("`external_id` must be 1 to {MAX_EXTERNAL_ID_CHARS} characters"),
        ));
    }
    if !trimmed
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(FieldError::invalid(
            "external_id",
            "`external_id` may contain only letters, digits, `_` and `-`",
        ));
    }
    Ok(trimmed.to_string())
}

pub fn validate_metadata(metadata: &BTreeMap<String, String>) -> Result<(), FieldError> {
    if metadata.len() > MAX_METADATA_KEYS {
        return Err(FieldError::invalid(
            "metadata",
            format!("at most {MAX_METADATA_KEYS} metadata keys"),
        ));
    }
    for (key, value) in metadata {
        if key.is_empty() || key.chars().count() > MAX_METADATA_KEY_CHARS {
            return Err(FieldError::invalid(
                format!("metadata.{key}"),
                format!("metadata keys must be 1 to {MAX_METADATA_KEY_CHARS} characters"),
            ));
        }
        if value.chars().count() > MAX_METADATA_VALUE_CHARS {
            return Err(FieldError::invalid(
                format!("metadata.{key}"),
                format!("metadata values are at most {MAX_METADATA_VALUE_CHARS} characters"),
            ));
        }
    }
    Ok(())
}

/// Validates input. On create, `email` is required and `Clear` is refused for it.
pub fn validate_customer_input(
    input: &CustomerInput,
    creating: bool,
) -> Result<CustomerChanges, FieldError> {
    let email = match &input.email {
        Patch::Keep if creating => return Err(FieldError::missing("email")),
        Patch::Keep => Patch::Keep,
        Patch::Clear => return Err(FieldError::invalid("email", "`email` cannot be null")),
        Patch::Set(email) => {
            let email = email.trim();
            if !is_valid_email(email) {
                return Err(FieldError::invalid(
                    "email",
                    "`email` is not a valid address",
                ));
            }
            Patch::Set(email.to_string())
        }
    };
    let name = match &input.name {
        Patch::Set(name) if name.chars().count() > MAX_NAME_CHARS => {
            return Err(FieldError::invalid(
                "name",
                format!("`name` is at most {MAX_NAME_CHARS} characters"),
            ))
        }
        other => other.clone(),
    };
    let country = match &input.country {
        Patch::Set(country) => {
            let valid = country.len() == 2 && country.chars().all(|c| c.is_ascii_uppercase());
            if !valid {
                return Err(FieldError::invalid(
                    "country",
                    "`country` must be an ISO 3166-1 alpha-2 code matching ^[A-Z]{2}$",
                ));
            }
            Patch::Set(country.clone())
        }
        other => other.clone(),
    };
    if let Patch::Set(metadata) = &input.metadata {
        validate_metadata(metadata)?;
    }
    let external_id = match &input.external_id {
        Patch::Set(raw) => Patch::Set(normalize_external_id(raw)?),
        other => other.clone(),
    };
    Ok(CustomerChanges {
        email,
        name,
        country,
        metadata: input.metadata.clone(),
        external_id,
    })
}

impl Customer {
    /// Applies validated changes (create starts from an empty customer).
    pub fn apply(&mut self, changes: CustomerChanges, now_ms: i64) {
        fn patch<T: Clone>(target: &mut Option<T>, patch: Patch<T>) {
            match patch {
                Patch::Keep => {}
                Patch::Clear => *target = None,
                Patch::Set(v) => *target = Some(v),
            }
        }
        if let Patch::Set(email) = changes.email {
            self.email = email;
        }
        patch(&mut self.name, changes.name);
        patch(&mut self.country, changes.country);
        match changes.metadata {
            Patch::Keep => {}
            Patch::Clear => self.metadata.clear(),
            Patch::Set(m) => self.metadata = m,
        }
        patch(&mut self.external_id, changes.external_id);
        self.updated_at_ms = now_ms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emails() {
        assert!(is_valid_email("a@b.co"));
        for bad in [
            "",
            "a",
            "a@b",
            "@b.co",
            "a@@b.co",
            "a b@c.co",
            "a@.co",
            "a\u{0}@b.co",
            "a@b.co\u{7f}",
        ] {
            assert!(!is_valid_email(bad), "{bad}");
        }
    }

    #[test]
    fn external_ids_are_trimmed_and_restricted() {
        assert_eq!(normalize_external_id("  user_1-a ").unwrap(), "user_1-a");
        assert!(normalize_external_id("user 1").is_err());
        assert!(normalize_external_id("   ").is_err());
        assert!(normalize_external_id(&"x".repeat(256)).is_err());
        assert!(normalize_external_id(&"x".repeat(255)).is_ok());
    }

    #[test]
    fn create_requires_email_and_checks_country() {
        let input = CustomerInput::default();
        assert_eq!(
            validate_customer_input(&input, true).unwrap_err().param,
            "email"
        );
        let input = CustomerInput {
            email: Patch::Set("a@b.co".into()),
            country: Patch::Set("de".into()),
            ..Default::default()
        };
        assert_eq!(
            validate_customer_input(&input, true).unwrap_err().param,
            "country"
        );
    }
}
