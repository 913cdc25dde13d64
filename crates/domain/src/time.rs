//! ISO 8601 parsing and formatting, and the time buckets usage is folded into.

use chrono::{DateTime, Datelike, NaiveDate, SecondsFormat, TimeZone, Utc};

/// Parses an ISO 8601 / RFC 3339 instant with an offset (`Z` or `+02:00`) into epoch ms.
/// Sub-millisecond digits are truncated.
pub fn parse_iso8601_ms(text: &str) -> Option<i64> {
    DateTime::parse_from_rfc3339(text.trim())
        .ok()
        .map(|t| t.timestamp_millis())
}

/// Formats epoch ms as `2026-11-22T10:00:00.000Z`.
pub fn format_iso8601_ms(epoch_ms: i64) -> String {
    match Utc.timestamp_millis_opt(epoch_ms).single() {
        Some(t) => t.to_rfc3339_opts(SecondsFormat::Millis, true),
        None => String::from("1970-01-01T00:00:00.000Z"),
    }
}

pub const MINUTE_MS: i64 = 60_000;
pub const HOUR_MS: i64 = 60 * MINUTE_MS;
pub const DAY_MS: i64 = 24 * HOUR_MS;

/// Usage query window sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    Minute,
    Hour,
    Day,
    Month,
    None,
}

impl Window {
    pub fn parse(text: &str) -> Option<Window> {
        Some(match text {
            "minute" => Window::Minute,
            "hour" => Window::Hour,
            "day" => Window::Day,
            "month" => Window::Month,
            "none" => Window::None,
            _ => return None,
        })
    }

    /// Start (epoch ms, UTC) of the window holding `at_ms`.
    pub fn start_of(self, at_ms: i64, range_start_ms: i64) -> i64 {
        match self {
            Window::Minute => at_ms.div_euclid(MINUTE_MS) * MINUTE_MS,
            Window::Hour => at_ms.div_euclid(HOUR_MS) * HOUR_MS,
            Window::Day => at_ms.div_euclid(DAY_MS) * DAY_MS,
            Window::Month => month_start_ms(at_ms),
            Window::None => range_start_ms,
        }
    }

    /// End (exclusive) of the window starting at `start_ms`.
    pub fn end_of(self, start_ms: i64, range_end_ms: i64) -> i64 {
        match self {
            Window::Minute => start_ms + MINUTE_MS,
            Window::Hour => start_ms + HOUR_MS,
            Window::Day => start_ms + DAY_MS,
            Window::Month => next_month_start_ms(start_ms),
            Window::None => range_end_ms,
        }
    }
}

fn month_start_ms(at_ms: i64) -> i64 {
    let t = Utc
        .timestamp_millis_opt(at_ms)
        .single()
        .unwrap_or_else(|| Utc.timestamp_millis_opt(0).unwrap());
    NaiveDate::from_ymd_opt(t.year(), t.month(), 1)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .map(|d| d.and_utc().timestamp_millis())
        .unwrap_or(0)
}

fn next_month_start_ms(month_start: i64) -> i64 {
    let t = Utc
        .timestamp_millis_opt(month_start)
        .single()
        .unwrap_or_else(|| Utc.timestamp_millis_opt(0).unwrap());
    let (year, month) = if t.month() == 12 {
        (t.year() + 1, 1)
    } else {
        (t.year(), t.month() + 1)
    };
    NaiveDate::from_ymd_opt(year, month, 1)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .map(|d| d.and_utc().timestamp_millis())
        .unwrap_or(i64::MAX)
}

/// The minute bucket usage of an event at `timestamp_ms` is folded into.
pub fn minute_bucket(timestamp_ms: i64) -> i64 {
    timestamp_ms.div_euclid(MINUTE_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_offsets_and_formats_utc() {
        let ms = parse_iso8601_ms("2026-11-22T12:00:00+02:00").unwrap();
        assert_eq!(format_iso8601_ms(ms), "2026-11-22T10:00:00.000Z");
        assert!(parse_iso8601_ms("2026-11-22 12:00").is_none());
        assert!(
            parse_iso8601_ms("2026-11-22T12:00:00").is_none(),
            "offset is required"
        );
    }

    #[test]
    fn month_windows_follow_the_calendar() {
        let at = parse_iso8601_ms("2024-02-15T10:00:00Z").unwrap();
        let start = Window::Month.start_of(at, 0);
        assert_eq!(format_iso8601_ms(start), "2024-02-01T00:00:00.000Z");
        let end = Window::Month.end_of(start, 0);
        assert_eq!(format_iso8601_ms(end), "2024-03-01T00:00:00.000Z");
        let dec = parse_iso8601_ms("2024-12-31T23:59:59Z").unwrap();
        let dec_end = Window::Month.end_of(Window::Month.start_of(dec, 0), 0);
        assert_eq!(format_iso8601_ms(dec_end), "2025-01-01T00:00:00.000Z");
    }
}
