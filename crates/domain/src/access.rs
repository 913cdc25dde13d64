//! What an API key may do (docs/api.md, "Keys and permissions"): a key holds
//! `all`, or permissions `<resource>:read` and `<resource>:write` (write includes
//! read). A request needs the permission of its resource (the first path segment
//! after `/v1`) and method (GET and HEAD read; everything else writes).

use crate::error::FieldError;

/// Every resource a permission can name, as its path segment.
pub const RESOURCES: &[&str] = &[
    "affiliates",
    "checkouts",
    "customer-credits",
    "customers",
    "discounts",
    "disputes",
    "events",
    "meters",
    "moderation",
    "products",
    "refunds",
    "store",
    "subscriptions",
    "tax-rates",
    "test-clock",
    "transactions",
    "webhooks",
];

/// Permissions one key holds at most.
pub const MAX_PERMISSIONS: usize = 64;

/// The permission that grants everything.
pub const ALL: &str = "all";

/// Checks a key's permissions (`permissions[N]` names a bad one); sorted, deduplicated.
pub fn parse_permissions(list: &[String]) -> Result<Vec<String>, FieldError> {
    if list.is_empty() || list.len() > MAX_PERMISSIONS {
        return Err(FieldError::invalid(
            "permissions",
            format!("1 to {MAX_PERMISSIONS} permissions: `all`, or `<resource>:read|write`"),
        ));
    }
    let mut out = Vec::new();
    for (i, p) in list.iter().enumerate() {
        let p = p.trim();
        let ok = p == ALL
            || p.split_once(':').is_some_and(|(resource, access)| {
                RESOURCES.contains(&resource) && (access == "read" || access == "write")
            });
        if !ok {
            return Err(FieldError::invalid(
                format!("permissions[{i}]"),
                format!("'{p}' is not `all` nor `<resource>:read|write` of a known resource"),
            ));
        }
        out.push(p.to_string());
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The permission a request needs, if its path is a resource of the API.
pub fn needed(path: &str, method: &str) -> Option<String> {
    let resource = path.strip_prefix("/v1/")?.split('/').next()?;
    let access = if method == "GET" || method == "HEAD" {
        "read"
    } else {
        "write"
    };
    RESOURCES
        .contains(&resource)
        .then(|| format!("{resource}:{access}"))
}

/// Whether `held` grants `needed` (`write` includes `read`).
pub fn allows(held: &[String], needed: &str) -> bool {
    held.iter().any(|p| {
        p == ALL
            || p == needed
            || needed
                .strip_suffix(":read")
                .is_some_and(|resource| *p == format!("{resource}:write"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_includes_read_and_all_includes_everything() {
        let held = vec!["meters:write".to_string(), "events:read".to_string()];
        assert!(allows(&held, "meters:read"));
        assert!(allows(&held, "meters:write"));
        assert!(allows(&held, "events:read"));
        assert!(!allows(&held, "events:write"));
        assert!(!allows(&held, "customers:read"));
        assert!(allows(&["all".to_string()], "webhooks:write"));
        assert_eq!(
            needed("/v1/meters/mtr_1/usage", "GET").as_deref(),
            Some("meters:read")
        );
        assert_eq!(
            needed("/v1/events/ingest", "POST").as_deref(),
            Some("events:write")
        );
        assert_eq!(needed("/healthz", "GET"), None);
        assert!(parse_permissions(&["meters:delete".into()]).is_err());
        assert_eq!(
            parse_permissions(&["meters:read".into(), "all".into(), "meters:read".into()]).unwrap(),
            vec!["all", "meters:read"]
        );
    }
}
