//! Webhooks: endpoint rules, event types, the signature scheme and the retry
//! schedule (docs/api.md, "Webhooks"). Pure: DNS resolution and
//! HTTP happen at the edge; they call [`is_forbidden_ip`] on what they resolve.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::FieldError;
use crate::ids::{EndpointId, StoreId};
use crate::mode::Mode;

/// Every event type an endpoint may subscribe to (docs/api.md).
pub const EVENT_TYPES: [&str; 20] = [
    "checkout.completed",
    "refund.created",
    "dispute.created",
    "subscription.active",
    "subscription.trialing",
    "subscription.canceled",
    "subscription.scheduled_cancel",
    "subscription.paid",
    "subscription.expired",
    "subscription.unpaid",
    "subscription.update",
    "subscription.past_due",
    "subscription.paused",
    "customer_credits.exhausted",
    "credits.granted",
    "credits.consumed",
    "credits.auto_recharged",
    "credits.auto_recharge_failed",
    "credits.expired",
    "credits.balance_low",
];

/// Retries after the first attempt (docs/api.md): 5 attempts in all.
pub const RETRY_OFFSETS_MS: [i64; 4] = [30_000, 5 * 60_000, 30 * 60_000, 6 * 3_600_000];
/// No attempt is made later than this after the first one.
pub const GIVE_UP_AFTER_MS: i64 = 24 * 3_600_000;
/// An old secret keeps signing deliveries this long after a rotation.
pub const ROTATED_SECRET_GRACE_MS: i64 = 24 * 3_600_000;
/// Receivers should reject signatures older than this (docs/api.md).
pub const SIGNATURE_TOLERANCE_S: i64 = 5 * 60;
pub const MAX_URL_CHARS: usize = 2048;
pub const MAX_ENDPOINT_NAME_CHARS: usize = 255;
/// Placeholder URL of `cli` endpoints (never called).
pub const CLI_PLACEHOLDER_URL: &str = "cli://tally-listen";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryMode {
    Http,
    Cli,
}

impl DeliveryMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryMode::Http => "http",
            DeliveryMode::Cli => "cli",
        }
    }
    pub fn parse(text: &str) -> Option<DeliveryMode> {
        match text {
            "http" => Some(DeliveryMode::Http),
            "cli" => Some(DeliveryMode::Cli),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct WebhookEndpoint {
    pub id: EndpointId,
    pub store_id: StoreId,
    pub mode: Mode,
    pub name: String,
    pub url: String,
    pub delivery_mode: DeliveryMode,
    pub enabled: bool,
    pub events: Vec<String>,
    pub secret: String,
    /// The secret before the last rotation, valid until `previous_secret_expires_at_ms`.
    pub previous_secret: Option<String>,
    pub previous_secret_expires_at_ms: i64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl WebhookEndpoint {
    /// The secrets that sign a delivery at `now_ms`: the current one, and the previous
    /// one during its grace period.
    pub fn signing_secrets(&self, now_ms: i64) -> Vec<&str> {
        let mut secrets = vec![self.secret.as_str()];
        if let Some(previous) = &self.previous_secret {
            if now_ms < self.previous_secret_expires_at_ms {
                secrets.push(previous);
            }
        }
        secrets
    }

    pub fn subscribes_to(&self, event_type: &str) -> bool {
        self.enabled && self.events.iter().any(|e| e == event_type)
    }
}

const fn v4(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> Ipv4Net {
    Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), prefix)
}

const fn v6(segments: [u16; 8], prefix: u8) -> Ipv6Net {
    let [a, b, c, d, e, f, g, h] = segments;
    Ipv6Net::new_assert(Ipv6Addr::new(a, b, c, d, e, f, g, h), prefix)
}

/// IPv4 networks a webhook may never reach (outside `--allow-private-webhooks`).
pub const FORBIDDEN_V4: [Ipv4Net; 14] = [
    v4(0, 0, 0, 0, 8),       // "this network", unspecified
    v4(10, 0, 0, 0, 8),      // private
    v4(100, 64, 0, 0, 10),   // CGNAT
    v4(127, 0, 0, 0, 8),     // loopback
    v4(169, 254, 0, 0, 16),  // link-local, the cloud metadata address among them
    v4(172, 16, 0, 0, 12),   // private
    v4(192, 0, 0, 0, 24),    // IETF protocol assignments
    v4(192, 0, 2, 0, 24),    // documentation (TEST-NET-1)
    v4(192, 168, 0, 0, 16),  // private
    v4(198, 18, 0, 0, 15),   // benchmarking
    v4(198, 51, 100, 0, 24), // documentation (TEST-NET-2)
    v4(203, 0, 113, 0, 24),  // documentation (TEST-NET-3)
    v4(224, 0, 0, 0, 4),     // multicast
    v4(240, 0, 0, 0, 4),     // reserved, broadcast
];

/// IPv6 networks a webhook may never reach; IPv4-mapped addresses are judged as
/// the IPv4 address they carry.
pub const FORBIDDEN_V6: [Ipv6Net; 9] = [
    v6([0, 0, 0, 0, 0, 0, 0, 0], 96), // unspecified, loopback, IPv4-compatible
    v6([0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 32), // NAT64 (well-known and local-use)
    v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 32), // Teredo
    v6([0x2001, 0x0db8, 0, 0, 0, 0, 0, 0], 32), // documentation
    v6([0x2002, 0, 0, 0, 0, 0, 0, 0], 16), // 6to4
    v6([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7), // unique local
    v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10), // link-local
    v6([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10), // site-local
    v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8), // multicast
];

/// Whether `ip` lies in a network a webhook may never reach ([`FORBIDDEN_V4`],
/// [`FORBIDDEN_V6`]: loopback, private, link-local, CGNAT, benchmarking, reserved,
/// documentation, multicast, and the IPv6 forms that embed or tunnel an IPv4
/// address).
pub fn is_forbidden_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => FORBIDDEN_V4.iter().any(|net| net.contains(&v4)),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_forbidden_ip(IpAddr::V4(v4)),
            None => FORBIDDEN_V6.iter().any(|net| net.contains(&v6)),
        },
    }
}

/// Whether a webhook of `mode` may reach `ip`: never a forbidden address, except
/// that test endpoints may reach loopback (local development); anything goes with
/// `allow_private` (a single-tenant deployment's own choice).
pub fn may_reach(ip: IpAddr, mode: Mode, allow_private: bool) -> bool {
    allow_private || !is_forbidden_ip(ip) || (mode == Mode::Test && ip.to_canonical().is_loopback())
}

/// Where an endpoint URL points, as the HTTP client will read it: the WHATWG URL
/// parser (the `url` crate, which reqwest uses too), so the host checked is the
/// host connected to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub scheme: String,
    pub host: url::Host<String>,
    pub port: u16,
}

/// Parses and checks an endpoint URL for `mode` (see `validate_url`).
pub fn endpoint_target(text: &str, mode: Mode, allow_private: bool) -> Result<Target, FieldError> {
    let invalid = |message: &str| FieldError::invalid("url", message);
    if text.chars().count() > MAX_URL_CHARS {
        return Err(FieldError::invalid(
            "url",
            format!("`url` is at most {MAX_URL_CHARS} characters"),
        ));
    }
    // Parsers disagree about `\` and control characters; refuse them outright.
    if text.contains('\\') || text.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(invalid(
            "`url` may not contain backslashes, spaces or control characters",
        ));
    }
    let url =
        url::Url::parse(text).map_err(|_| invalid("`url` must be an absolute http(s) URL"))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid("`url` may not carry credentials (user:password@)"));
    }
    let scheme = url.scheme().to_string();
    match (mode, scheme.as_str()) {
        (Mode::Prod, "https") => {}
        (Mode::Prod, "http") if allow_private => {}
        (Mode::Prod, _) => return Err(invalid("production endpoints need an https:// URL")),
        (Mode::Test, "https" | "http") => {}
        (Mode::Test, _) => return Err(invalid("`url` must be http:// or https://")),
    }
    let host = url
        .host()
        .map(|h| h.to_owned())
        .ok_or_else(|| invalid("`url` must name a host"))?;
    let port = url.port_or_known_default().unwrap_or(443);
    let refused = || {
        invalid(if mode == Mode::Prod {
            "production endpoints must be public: loopback, private, link-local and metadata addresses are refused"
        } else {
            "test endpoints may be public or loopback; private, link-local and metadata addresses are refused"
        })
    };
    match &host {
        url::Host::Ipv4(ip) if !may_reach(IpAddr::V4(*ip), mode, allow_private) => {
            return Err(refused())
        }
        url::Host::Ipv6(ip) if !may_reach(IpAddr::V6(*ip), mode, allow_private) => {
            return Err(refused())
        }
        url::Host::Domain(name) if !allow_private => {
            // A trailing dot names the same host ("localhost." is localhost).
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            let local = name == "localhost" || name.ends_with(".localhost");
            let internal = name.ends_with(".internal")
                || name.ends_with(".local")
                || name.ends_with(".home.arpa")
                || (!name.contains('.') && !local);
            if internal || (local && mode == Mode::Prod) {
                return Err(refused());
            }
        }
        _ => {}
    }
    Ok(Target { scheme, host, port })
}

/// Checks an endpoint URL for the environment: production needs `https://` and a
/// public host (unless private targets are allowed); test accepts `http://` and
/// loopback for local development, never private or metadata addresses.
pub fn validate_url(url: &str, mode: Mode, allow_private: bool) -> Result<(), FieldError> {
    endpoint_target(url, mode, allow_private).map(|_| ())
}

/// The subscribed event types as stored: checked (the first unknown one is named),
/// each once, in the order first given.
pub fn event_types(events: &[String]) -> Result<Vec<String>, FieldError> {
    if events.is_empty() {
        return Err(FieldError::invalid(
            "events",
            "`events` needs at least one event type",
        ));
    }
    for (i, event) in events.iter().enumerate() {
        if !EVENT_TYPES.contains(&event.as_str()) {
            return Err(FieldError::invalid(
                format!("events[{i}]"),
                format!("unknown event type `{event}`"),
            ));
        }
    }
    let mut seen = std::collections::HashSet::new();
    Ok(events
        .iter()
        .filter(|e| seen.insert(e.as_str()))
        .cloned()
        .collect())
}

fn hmac_hex(secret: &str, timestamp_s: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    mac.update(timestamp_s.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    hex::encode(mac.finalize().into_bytes())
}

/// `tally-signature`: `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`,
/// with one more space-separated `v1=` per extra secret (rotation grace period).
pub fn signature_header(secrets: &[&str], timestamp_s: i64, body: &[u8]) -> String {
    let signatures: Vec<String> = secrets
        .iter()
        .map(|s| format!("v1={}", hmac_hex(s, timestamp_s, body)))
        .collect();
    format!("t={timestamp_s},{}", signatures.join(" "))
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the signature header is malformed (expected t=<seconds>,v1=<hex>)")]
    Malformed,
    #[error(
        "the signature timestamp is more than {} minutes away from now",
        SIGNATURE_TOLERANCE_S / 60
    )]
    Expired,
    #[error("no v1 signature matches the secret and body")]
    Mismatch,
}

/// Verifies a `tally-signature` header against a secret and the raw body.
pub fn verify_signature(
    header: &str,
    secret: &str,
    body: &[u8],
    now_s: i64,
) -> Result<(), SignatureError> {
    let (t, signatures) = header.split_once(',').ok_or(SignatureError::Malformed)?;
    let timestamp: i64 = t
        .trim()
        .strip_prefix("t=")
        .and_then(|v| v.parse().ok())
        .ok_or(SignatureError::Malformed)?;
    if (now_s - timestamp).abs() > SIGNATURE_TOLERANCE_S {
        return Err(SignatureError::Expired);
    }
    let expected = hmac_hex(secret, timestamp, body);
    let candidates: Vec<&str> = signatures
        .split([' ', ','])
        .filter_map(|s| s.trim().strip_prefix("v1="))
        .collect();
    if candidates.is_empty() {
        return Err(SignatureError::Malformed);
    }
    // Constant-time comparison of equal-length hex strings.
    let matches = candidates.iter().any(|c| {
        c.len() == expected.len()
            && c.bytes()
                .zip(expected.bytes())
                .fold(0u8, |acc, (x, y)| acc | (x ^ y))
                == 0
    });
    if matches {
        Ok(())
    } else {
        Err(SignatureError::Mismatch)
    }
}

/// When the next attempt is due after `attempts_made` attempts, the first at
/// `first_attempt_at_ms`; `None` when the schedule is over.
pub fn next_attempt_at(first_attempt_at_ms: i64, attempts_made: u32) -> Option<i64> {
    let offset = *RETRY_OFFSETS_MS.get((attempts_made as usize).checked_sub(1)?)?;
    (offset < GIVE_UP_AFTER_MS).then_some(first_attempt_at_ms + offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_is_30s_5m_30m_6h_then_over() {
        assert_eq!(next_attempt_at(0, 1), Some(30_000));
        assert_eq!(next_attempt_at(0, 2), Some(300_000));
        assert_eq!(next_attempt_at(0, 3), Some(1_800_000));
        assert_eq!(next_attempt_at(0, 4), Some(21_600_000));
        assert_eq!(next_attempt_at(0, 5), None);
    }

    #[test]
    fn signatures_verify_and_reject() {
        let header = signature_header(&["whsec_a", "whsec_b"], 1_000, b"{\"x\":1}");
        assert!(header.starts_with("t=1000,v1="));
        assert!(header.contains(" v1="));
        assert_eq!(
            verify_signature(&header, "whsec_a", b"{\"x\":1}", 1_010),
            Ok(())
        );
        assert_eq!(
            verify_signature(&header, "whsec_b", b"{\"x\":1}", 1_010),
            Ok(())
        );
        assert_eq!(
            verify_signature(&header, "whsec_c", b"{\"x\":1}", 1_010),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify_signature(&header, "whsec_a", b"{\"x\":2}", 1_010),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify_signature(&header, "whsec_a", b"{\"x\":1}", 2_000),
            Err(SignatureError::Expired)
        );
        assert_eq!(
            verify_signature("nonsense", "whsec_a", b"", 0),
            Err(SignatureError::Malformed)
        );
    }

    #[test]
    fn production_urls_must_be_public_https() {
        assert!(validate_url("https://hooks.example.com/x", Mode::Prod, false).is_ok());
        for bad in [
            "http://hooks.example.com/x",
            "https://127.0.0.1/x",
            "https://10.1.2.3/",
            "https://169.254.169.254/latest",
            "https://[::1]:8443/",
            "https://localhost/",
            "https://LocalHost./",
            "https://192.168.0.10:443/",
            "ftp://x.com",
            "not a url",
        ] {
            assert!(validate_url(bad, Mode::Prod, false).is_err(), "{bad}");
        }
        assert!(validate_url("http://127.0.0.1:9000/hook", Mode::Test, false).is_ok());
        assert!(validate_url("https://127.0.0.1/x", Mode::Prod, true).is_ok());
        assert!(is_forbidden_ip("::ffff:10.0.0.1".parse().unwrap()));
        assert!(!is_forbidden_ip("93.184.216.34".parse().unwrap()));
    }

    /// The rules as first written by hand (range tests on octets and segments): the
    /// network table must decide every address the same way.
    /// Addresses a webhook may never reach (outside `--allow-private-webhooks`):
    /// loopback, private, link-local (the cloud metadata address 169.254.169.254
    /// among them), CGNAT, benchmarking (198.18/15), reserved (240/4), IETF protocol
    /// assignments (192.0.0/24), documentation, unspecified, broadcast, multicast; in
    /// IPv6 the same, plus the forms that embed or tunnel an IPv4 address (mapped,
    /// compatible, NAT64, 6to4, Teredo) and site-local.
    fn reference_is_forbidden(ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(v4) => {
                let [a, b, c, _] = v4.octets();
                v4.is_loopback()
                    || v4.is_private()
                    || v4.is_link_local()
                    || v4.is_unspecified()
                    || v4.is_broadcast()
                    || v4.is_multicast()
                    || v4.is_documentation()
                    || a == 0
                    || (a == 100 && (64..128).contains(&b))
                    || (a == 198 && (b == 18 || b == 19))
                    || a >= 240
                    || (a == 192 && b == 0 && c == 0)
            }
            IpAddr::V6(v6) => {
                if let Some(v4) = v6.to_ipv4_mapped() {
                    return reference_is_forbidden(IpAddr::V4(v4));
                }
                let s = v6.segments();
                let compatible = s[..6] == [0; 6] && !v6.is_loopback() && !v6.is_unspecified();
                let nat64 = s[0] == 0x64 && s[1] == 0xff9b;
                v6.is_loopback()
                    || v6.is_unspecified()
                    || v6.is_multicast()
                    || compatible
                    || nat64
                    || s[0] == 0x2002
                    || (s[0] == 0x2001 && s[1] == 0)
                    || (s[0] == 0x2001 && s[1] == 0x0db8)
                    || (s[0] & 0xfe00) == 0xfc00
                    || (s[0] & 0xffc0) == 0xfe80
                    || (s[0] & 0xffc0) == 0xfec0
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn the_network_table_matches_the_hand_written_rules(v4 in proptest::num::u32::ANY, v6 in proptest::num::u128::ANY, pick in 0u8..4) {
            let v4 = Ipv4Addr::from(v4);
            proptest::prop_assert_eq!(is_forbidden_ip(IpAddr::V4(v4)), reference_is_forbidden(IpAddr::V4(v4)));
            // Random IPv6 addresses rarely land in a listed network: also try them
            // inside each network's prefix.
            let v6 = match pick {
                0 => Ipv6Addr::from(v6),
                _ => {
                    let net = FORBIDDEN_V6[(v6 % FORBIDDEN_V6.len() as u128) as usize];
                    let host = (v6 >> 8) & !u128::from(net.netmask());
                    Ipv6Addr::from(u128::from(net.network()) | host)
                }
            };
            proptest::prop_assert_eq!(is_forbidden_ip(IpAddr::V6(v6)), reference_is_forbidden(IpAddr::V6(v6)));
        }
    }

    #[test]
    fn network_edges_are_decided_like_the_hand_written_rules() {
        for net in FORBIDDEN_V4 {
            for ip in [net.network(), net.broadcast()] {
                let before = Ipv4Addr::from(u32::from(ip).wrapping_sub(1));
                let after = Ipv4Addr::from(u32::from(ip).wrapping_add(1));
                for ip in [ip, before, after] {
                    assert_eq!(
                        is_forbidden_ip(ip.into()),
                        reference_is_forbidden(ip.into()),
                        "{ip}"
                    );
                }
            }
        }
        for net in FORBIDDEN_V6 {
            for ip in [net.network(), net.broadcast()] {
                let before = Ipv6Addr::from(u128::from(ip).wrapping_sub(1));
                let after = Ipv6Addr::from(u128::from(ip).wrapping_add(1));
                for ip in [ip, before, after] {
                    assert_eq!(
                        is_forbidden_ip(ip.into()),
                        reference_is_forbidden(ip.into()),
                        "{ip}"
                    );
                }
            }
        }
    }

    /// The parser-differential and encoding tricks that reach internal addresses.
    #[test]
    fn ssrf_spellings_are_refused() {
        // Loopback spelled otherwise: refused in production, loopback for test.
        let loopback = [
            "https://0x7f.0.0.1/",
            "https://2130706433/",
            "https://0177.0.0.1/",
            "https://127.1/",
            "https://[::ffff:7f00:1]/",
        ];
        let everywhere = [
            // reqwest ends the host at `\\`: this would connect to 127.0.0.1.
            "https://127.0.0.1\\@example.com/",
            "https://grafana.corp.internal\\@example.com/",
            "https://user:pass@example.com/",
            "https://example.com@127.0.0.1/",
            "https://169.254.169.254/",
            "https://[::ffff:169.254.169.254]/",
            "https://[::10.0.0.1]/",
            "https://[64:ff9b::a9fe:a9fe]/",
            "https://[2002:a00:1::]/",
            "https://[fec0::1]/",
            "https://[fe80::1]/",
            "https://[fd00::1]/",
            "https://198.18.0.1/",
            "https://240.0.0.1/",
            "https://192.0.0.8/",
            "https://100.64.0.1/",
            "https://10.0.0.5:22/",
            "https://0.0.0.0/",
            "https://metadata.google.internal/",
            "https://printer.local/",
            "https://intranet/",
            "https://router.home.arpa/",
            "https://exa mple.com/",
        ];
        for bad in loopback.iter().chain(&everywhere) {
            assert!(
                validate_url(bad, Mode::Prod, false).is_err(),
                "prod accepted {bad}"
            );
        }
        for bad in everywhere {
            assert!(
                validate_url(bad, Mode::Test, false).is_err(),
                "test accepted {bad}"
            );
        }
        for spelling in loopback {
            assert!(
                validate_url(spelling, Mode::Test, false).is_ok(),
                "{spelling}"
            );
        }
        // Test endpoints: loopback (any spelling) and public hosts; nothing private.
        for good in [
            "http://localhost:3000/h",
            "http://127.0.0.1/",
            "http://[::1]:8080/",
            "https://hooks.example.com/",
        ] {
            assert!(validate_url(good, Mode::Test, false).is_ok(), "{good}");
        }
        let target =
            endpoint_target("https://Hooks.Example.com:8443/x", Mode::Prod, false).unwrap();
        assert_eq!(
            target.host,
            url::Host::Domain("hooks.example.com".to_string())
        );
        assert_eq!(target.port, 8443);
    }

    #[test]
    fn event_types_are_checked() {
        assert!(event_types(&["credits.granted".into()]).is_ok());
        assert_eq!(
            event_types(&[
                "credits.granted".into(),
                "refund.created".into(),
                "credits.granted".into()
            ])
            .unwrap(),
            ["credits.granted", "refund.created"],
            "each once, in the order given"
        );
        assert_eq!(
            event_types(&["credits.granted".into(), "nope".into()])
                .unwrap_err()
                .param,
            "events[1]"
        );
    }
}
