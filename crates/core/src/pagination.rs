//! Cursor pagination over an index whose keys sort oldest first; lists come back
//! newest first (docs/api.md). `starting_after` pages towards older items,
//! `ending_before` towards newer ones; `has_more` is exact (one extra item is read).

use std::ops::Bound;

use tally_projection::{prefix_end, scan_prefix, ProjectionStore, Visit};

use crate::error::EngineError;

#[derive(Debug, Clone, Default)]
pub struct PageRequest {
    pub limit: usize,
    pub starting_after: Option<String>,
    pub ending_before: Option<String>,
}

/// Which items of a resource that can be archived a list returns (`status=`):
/// active ones by default (docs/api.md, "Lists").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StatusFilter {
    #[default]
    Active,
    Archived,
    All,
}

impl StatusFilter {
    /// The `status` query value; `None` when it names no filter.
    pub fn parse(text: &str) -> Option<StatusFilter> {
        match text {
            "active" => Some(StatusFilter::Active),
            "archived" => Some(StatusFilter::Archived),
            "all" => Some(StatusFilter::All),
            _ => None,
        }
    }

    /// Whether an item, active or not, is listed.
    pub fn keeps(self, active: bool) -> bool {
        match self {
            StatusFilter::All => true,
            StatusFilter::Active => active,
            StatusFilter::Archived => !active,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Page<T> {
    pub data: Vec<T>,
    pub has_more: bool,
}

/// Where a cursor points: the index key of the cursor item.
pub enum Cursor {
    None,
    After(Vec<u8>),
    Before(Vec<u8>),
}

/// Visits the index under `prefix` from `cursor`, turning entries into items with
/// `load` (which may skip an entry by returning `None`).
pub fn paginate<T>(
    store: &dyn ProjectionStore,
    prefix: &[u8],
    cursor: Cursor,
    limit: usize,
    mut load: impl FnMut(&[u8], &[u8]) -> Result<Option<T>, EngineError>,
) -> Result<Page<T>, EngineError> {
    let end = prefix_end(prefix).unwrap_or_else(|| vec![0xff; prefix.len() + 1]);
    let mut items = Vec::with_capacity(limit + 1);
    let mut failure = None;
    let mut visit = |k: &[u8], v: &[u8]| match load(k, v) {
        Ok(Some(item)) => {
            items.push(item);
            if items.len() > limit {
                Visit::Stop
            } else {
                Visit::Continue
            }
        }
        Ok(None) => Visit::Continue,
        Err(e) => {
            failure = Some(e);
            Visit::Stop
        }
    };
    let towards_newer = matches!(cursor, Cursor::Before(_));
    match &cursor {
        Cursor::None => store.scan(
            Bound::Included(prefix),
            Bound::Excluded(&end),
            true,
            &mut visit,
        )?,
        Cursor::After(key) => store.scan(
            Bound::Included(prefix),
            Bound::Excluded(key),
            true,
            &mut visit,
        )?,
        Cursor::Before(key) => store.scan(
            Bound::Excluded(key),
            Bound::Excluded(&end),
            false,
            &mut visit,
        )?,
    }
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(Page::from_scan(items, limit, towards_newer))
}

impl<T> Page<T> {
    /// A page from a scan that read up to `limit + 1` items in scan order: the extra
    /// one says there is more (exact `has_more`), and a scan towards newer items
    /// (`ending_before`) is turned back to newest first.
    pub fn from_scan(mut items: Vec<T>, limit: usize, towards_newer: bool) -> Page<T> {
        let has_more = items.len() > limit;
        items.truncate(limit);
        if towards_newer {
            items.reverse();
        }
        Page {
            data: items,
            has_more,
        }
    }
}

/// Decodes the entries under `prefix` in key order (or reversed), keeping those
/// `decode` returns `Some` for, at most `limit` of them; stops at the first error.
pub fn collect_prefix<T>(
    store: &dyn ProjectionStore,
    prefix: &[u8],
    reverse: bool,
    limit: usize,
    mut decode: impl FnMut(&[u8], &[u8]) -> Result<Option<T>, EngineError>,
) -> Result<Vec<T>, EngineError> {
    let mut items = Vec::new();
    let mut failure = None;
    scan_prefix(store, prefix, reverse, &mut |k, v| match decode(k, v) {
        Ok(Some(item)) => {
            items.push(item);
            if items.len() >= limit {
                Visit::Stop
            } else {
                Visit::Continue
            }
        }
        Ok(None) => Visit::Continue,
        Err(e) => {
            failure = Some(e);
            Visit::Stop
        }
    })?;
    match failure {
        Some(e) => Err(e),
        None => Ok(items),
    }
}

/// Resolves the cursor ids of a page request to index keys (404 for an unknown id).
pub fn cursor_from(
    page: &PageRequest,
    key_of: impl Fn(&str) -> Result<Vec<u8>, EngineError>,
) -> Result<Cursor, EngineError> {
    let with_param = |param: &str, e: EngineError| e.for_param(param);
    Ok(match (&page.starting_after, &page.ending_before) {
        (Some(_), Some(_)) => {
            return Err(tally_domain::FieldError::invalid(
                "ending_before",
                "give at most one of `starting_after` and `ending_before`",
            )
            .into())
        }
        (Some(id), None) => Cursor::After(key_of(id).map_err(|e| with_param("starting_after", e))?),
        (None, Some(id)) => Cursor::Before(key_of(id).map_err(|e| with_param("ending_before", e))?),
        (None, None) => Cursor::None,
    })
}

/// A page of a page-based list (affiliates, invitations; docs/api.md, "Lists").
#[derive(Debug, Clone)]
pub struct PageBased<T> {
    pub items: Vec<T>,
    pub total_records: usize,
    pub page: usize,
    pub page_size: usize,
}

impl<T> PageBased<T> {
    pub fn total_pages(&self) -> usize {
        self.total_records.div_ceil(self.page_size.max(1))
    }
}

/// Page `page` (1-based) of `page_size` entries under `prefix`, newest first,
/// counting every entry for `total_records` (at most `max_entries`: the lists it
/// serves are bounded by that).
pub fn page_based<T>(
    store: &dyn ProjectionStore,
    prefix: &[u8],
    page: usize,
    page_size: usize,
    max_entries: usize,
    mut load: impl FnMut(&[u8]) -> Result<T, EngineError>,
) -> Result<PageBased<T>, EngineError> {
    let skip = page.saturating_sub(1).saturating_mul(page_size);
    let mut keys = Vec::new();
    let mut total = 0usize;
    scan_prefix(store, prefix, true, &mut |key, _| {
        if total >= skip && keys.len() < page_size {
            keys.push(key.to_vec());
        }
        total += 1;
        if total < max_entries {
            Visit::Continue
        } else {
            Visit::Stop
        }
    })?;
    let items = keys
        .iter()
        .map(|k| load(k))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PageBased {
        items,
        total_records: total,
        page,
        page_size,
    })
}

/// The cursor contract over items already in memory, newest first (small bounded
/// lists): `starting_after` the items after the named one, `ending_before` the
/// `limit` just before it; an unknown id is a 404 naming the parameter.
pub fn paginate_slice<T>(
    items: Vec<T>,
    page: &PageRequest,
    id_of: impl Fn(&T) -> String,
) -> Result<Page<T>, EngineError> {
    let position = |param: &str, id: &str| {
        items
            .iter()
            .position(|item| id_of(item) == id)
            .ok_or_else(|| EngineError::not_found("item", id).for_param(param))
    };
    let (start, end) = match (&page.starting_after, &page.ending_before) {
        (Some(_), Some(_)) => {
            return Err(tally_domain::FieldError::invalid(
                "ending_before",
                "give at most one of `starting_after` and `ending_before`",
            )
            .into())
        }
        (Some(id), None) => {
            let at = position("starting_after", id)? + 1;
            (at, (at + page.limit).min(items.len()))
        }
        (None, Some(id)) => {
            let at = position("ending_before", id)?;
            (at.saturating_sub(page.limit), at)
        }
        (None, None) => (0, page.limit.min(items.len())),
    };
    let has_more = match &page.ending_before {
        Some(_) => start > 0,
        None => end < items.len(),
    };
    let data = items.into_iter().skip(start).take(end - start).collect();
    Ok(Page { data, has_more })
}
