//! Rows that hold many keys: how the sled store packs the keys of some tables.
//!
//! A scoped key is `table · scope text · 0x00 · mode byte · components…`. For a
//! **packed table** the store keeps one sled row per key with its first component
//! left out (the row key), and the row's value lists that component of each key
//! (the entry) with the key's value. For usage buckets (`table, store, mode, meter,
//! customer, minute`) that is one row per customer and minute holding every meter's
//! bucket: a checkpoint writes one row where it wrote one key per meter, and sled
//! keeps a twentieth of the keys in its page table (docs/benchmarks.md, "Bucket rows").
//!
//! Readers never see rows: `get` and `scan` answer in keys, in key order, as if the
//! table were not packed. Within one slice (a table, scope and entry: one meter's
//! buckets) the rows' order is the keys' order, so a scan inside a slice is one
//! range read of rows, each filtered to the slice's entry; a scan across slices
//! walks each slice it meets in turn, taken from the slice directory
//! ([`SLICE_PREFIX`]). A row holds at most one entry per meter of its store, so the
//! meters-per-store limit bounds its size.
//!
//! Which tables are packed is chosen when a store is created and recorded in it
//! ([`PACKING_KEY`]), so a reopened store reads its rows the way they were written
//! whoever opens it.

use std::collections::BTreeMap;
use std::ops::{Bound, Range};

use crate::{ChangeVisit, StoreError};

/// A row's entries and their values, borrowed from the row.
pub(crate) type RowEntries<'r> = Vec<(&'r [u8], &'r [u8])>;

/// A range of sled keys, owned.
pub(crate) type KeyRange = (Bound<Vec<u8>>, Bound<Vec<u8>>);

/// Reads a row's stored value.
pub(crate) type RowRead<'a> = dyn FnMut(&[u8]) -> Result<Option<Vec<u8>>, StoreError> + 'a;

/// Visits a sled key and value; may fail.
pub(crate) type RawVisit<'a> = dyn FnMut(&[u8], &[u8]) -> Result<crate::Visit, StoreError> + 'a;

/// Where a store records its packing: below the positions, so scans skip it.
pub(crate) const PACKING_KEY: &[u8] = b"\x00pack\x00";

/// The slice directory: one key per slice ever written (this prefix, then the
/// slice's prefix), below the positions too. A scan across slices takes them from
/// here (in memory) instead of reading every row to learn which meters exist; a
/// slice whose rows were all deleted stays listed and is read as empty.
pub(crate) const SLICE_PREFIX: &[u8] = b"\x00pack-slice\x00";

/// The tables whose keys a store packs into rows (module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Packing {
    /// Sorted, no repeats; never 0x00 (positions and markers) or 0xFF (a table's
    /// end must be a byte).
    tables: Vec<u8>,
}

impl Packing {
    /// Packs nothing: every key is a sled key.
    pub fn none() -> Packing {
        Packing::default()
    }

    /// Packs the keys of these tables (table bytes 0x00 and 0xFF are left out:
    /// neither can be a scoped table).
    pub fn tables(tables: &[u8]) -> Packing {
        let mut tables: Vec<u8> = tables
            .iter()
            .copied()
            .filter(|t| *t != 0 && *t != u8::MAX)
            .collect();
        tables.sort_unstable();
        tables.dedup();
        Packing { tables }
    }

    pub fn is_none(&self) -> bool {
        self.tables.is_empty()
    }

    /// The packed tables, ascending.
    pub fn packed_tables(&self) -> &[u8] {
        &self.tables
    }

    pub(crate) fn packs(&self, key: &[u8]) -> bool {
        key.first()
            .is_some_and(|table| self.tables.binary_search(table).is_ok())
    }

    /// As recorded in a store (`PACKING_KEY`).
    pub(crate) fn encode(&self) -> Vec<u8> {
        self.tables.clone()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Packing {
        Packing::tables(bytes)
    }
}

/// Where the scope (table byte, scope text and its separator, mode byte) of a
/// packed key or row ends; `None` for bytes too short to hold one.
fn scope_end(key: &[u8]) -> Option<usize> {
    let separator = key.get(1..)?.iter().position(|b| *b == 0)?;
    let end = 1 + separator + 2;
    (end <= key.len()).then_some(end)
}

/// The slice prefix of a key (scope, entry and its separator) and where the scope
/// ends; `None` for a key without a whole entry.
fn slice_of(key: &[u8]) -> Option<(&[u8], usize)> {
    let scope = scope_end(key)?;
    let entry = key[scope..].iter().position(|b| *b == 0)?;
    Some((&key[..scope + entry + 1], scope))
}

/// The slice prefix of a packed key (table, scope, entry, separator).
pub(crate) fn slice_prefix(key: &[u8]) -> Option<&[u8]> {
    slice_of(key).map(|(prefix, _)| prefix)
}

/// A packed key's row key and entry; an error for a key of a packed table that
/// has no entry (nothing in this service writes one).
pub(crate) fn split(key: &[u8]) -> Result<(Vec<u8>, &[u8]), StoreError> {
    let mut row = Vec::with_capacity(key.len());
    let entry = row_key_into(key, &mut row)?;
    Ok((row, &key[entry]))
}

fn unpackable(key: &[u8]) -> StoreError {
    StoreError::Backend(format!(
        "key {key:?} of a packed table has no component to pack by"
    ))
}

/// The key of `entry` in the row `row` (`split` backwards).
fn join(slice: &[u8], scope: usize, row: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(slice.len() + row.len() - scope);
    key.extend_from_slice(slice);
    key.extend_from_slice(&row[scope..]);
    key
}

/// Reads one length-prefixed part of a row (`None`: the row is cut short).
fn part<'r>(rest: &mut &'r [u8]) -> Option<&'r [u8]> {
    let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let bytes = rest.get(4..4usize.checked_add(len)?)?;
    *rest = &rest[4 + len..];
    Some(bytes)
}

/// Visits the entries of a row in entry order (each a u32 length and the entry,
/// then a u32 length and the value) until `visit` returns `true`.
fn walk_row<'r>(
    row: &'r [u8],
    visit: &mut dyn FnMut(&'r [u8], &'r [u8]) -> bool,
) -> Result<(), StoreError> {
    let mut rest = row;
    while !rest.is_empty() {
        match (part(&mut rest), part(&mut rest)) {
            (Some(entry), Some(value)) => {
                if visit(entry, value) {
                    break;
                }
            }
            _ => {
                return Err(StoreError::Corrupt(
                    "a packed row does not decode".to_string(),
                ))
            }
        }
    }
    Ok(())
}

/// The entries of a row, in entry order.
pub(crate) fn decode_row(row: &[u8]) -> Result<RowEntries<'_>, StoreError> {
    let mut entries = Vec::new();
    walk_row(row, &mut |entry, value| {
        entries.push((entry, value));
        false
    })?;
    Ok(entries)
}

fn encode_row<'a>(entries: impl Iterator<Item = (&'a [u8], &'a [u8])>) -> Vec<u8> {
    let mut row = Vec::new();
    for (entry, value) in entries {
        for part in [entry, value] {
            // Keys and values are far below 4 GiB (sled's own limit).
            row.extend_from_slice(&(part.len() as u32).to_be_bytes());
            row.extend_from_slice(part);
        }
    }
    row
}

/// The value of `entry` in an encoded row.
pub(crate) fn find(row: &[u8], entry: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
    let mut found = None;
    walk_row(row, &mut |e, value| {
        if e == entry {
            found = Some(value.to_vec());
        }
        found.is_some()
    })?;
    Ok(found)
}

/// Changes of packed tables one pass of a checkpoint gathers at most (on
/// average): a checkpoint of more is merged in several passes, each taking the
/// rows of one range of row keys. Bounds memory: a row gathers changes from every
/// slice (meter), so none can be written before the whole checkpoint was visited,
/// and gathering ~200,000 changes at once held ~66 MB at the server's peak (a heap
/// profile under the ingest benchmark; docs/benchmarks.md, "Memory at the peak"). A pass costs
/// one more visit of the changes. Ranges, not shares by hash: the passes write the
/// rows in key order once over, where hashed shares swept sled's tree once per pass.
pub const ROW_PASS_CHANGES: usize = 50_000;

/// The changes of one checkpoint to packed tables, grouped by row: each row's
/// changes in the order given (a later change of an entry wins), their bytes in
/// one arena. Why not a map of copies: a checkpoint passes ~200,000 changes
/// through here, and an allocation per row key, entry and value was ~a tenth of
/// the checkpoint thread.
#[derive(Debug, Default)]
pub(crate) struct RowChanges {
    rows: BTreeMap<Vec<u8>, Vec<EntryChange>>,
    arena: Vec<u8>,
    /// The row key being looked up (reused).
    scratch: Vec<u8>,
    /// The rows gathered: from `from` (included) until `until` (excluded).
    from: Option<Vec<u8>>,
    until: Option<Vec<u8>>,
}

/// One change of a row: where its entry and its value (`None`: deleted) are in
/// the arena.
type EntryChange = (Range<usize>, Option<Range<usize>>);

/// Puts the row key of a packed key in `row`; returns where the key's entry is.
pub(crate) fn row_key_into(key: &[u8], row: &mut Vec<u8>) -> Result<Range<usize>, StoreError> {
    let (slice, scope) = slice_of(key).ok_or_else(|| unpackable(key))?;
    row.clear();
    row.extend_from_slice(&key[..scope]);
    row.extend_from_slice(&key[slice.len()..]);
    Ok(scope..slice.len() - 1)
}

impl RowChanges {
    /// How many passes merge `changes` changes (at least one).
    pub(crate) fn passes_for(changes: usize) -> usize {
        changes.div_ceil(ROW_PASS_CHANGES).max(1)
    }

    /// Gathers the rows from `from` (included; `None`: the first) until `until`
    /// (excluded; `None`: the last).
    pub(crate) fn between(from: Option<Vec<u8>>, until: Option<Vec<u8>>) -> RowChanges {
        RowChanges {
            from,
            until,
            ..RowChanges::default()
        }
    }

    /// Takes a change of a packed table if its row is in this one's range.
    pub(crate) fn add(&mut self, key: &[u8], value: Option<&[u8]>) -> Result<(), StoreError> {
        let entry = row_key_into(key, &mut self.scratch)?;
        let row = self.scratch.as_slice();
        let before = self.from.as_deref().is_some_and(|from| row < from);
        let after = self.until.as_deref().is_some_and(|until| row >= until);
        if before || after {
            return Ok(());
        }
        let mut stash = |bytes: &[u8]| {
            let at = self.arena.len();
            self.arena.extend_from_slice(bytes);
            at..self.arena.len()
        };
        let change = (stash(&key[entry]), value.map(&mut stash));
        match self.rows.get_mut(self.scratch.as_slice()) {
            Some(changes) => changes.push(change),
            None => {
                self.rows.insert(self.scratch.clone(), vec![change]);
            }
        }
        Ok(())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Each changed row's new value (`None`: no entry left), from its stored value
    /// (`stored`) and the changes; rows in key order.
    pub(crate) fn merged(
        &self,
        stored: &mut RowRead<'_>,
        write: &mut ChangeVisit<'_>,
    ) -> Result<(), StoreError> {
        for (row, changes) in &self.rows {
            let old = stored(row)?;
            let mut entries: BTreeMap<&[u8], &[u8]> = match &old {
                Some(bytes) => decode_row(bytes)?.into_iter().collect(),
                None => BTreeMap::new(),
            };
            for (entry, value) in changes {
                let entry = &self.arena[entry.clone()];
                match value {
                    Some(value) => entries.insert(entry, &self.arena[value.clone()]),
                    None => entries.remove(entry),
                };
            }
            if entries.is_empty() {
                write(row, None)?;
            } else {
                write(row, Some(&encode_row(entries.into_iter())))?;
            }
        }
        Ok(())
    }
}

/// Where a scan goes: a range of plain keys, or a range of one packed table's keys.
#[derive(Debug)]
pub(crate) enum Segment {
    Plain(Bound<Vec<u8>>, Bound<Vec<u8>>),
    Packed(Bound<Vec<u8>>, Bound<Vec<u8>>),
}

/// Whether no key lies between two bounds.
pub(crate) fn is_empty_range(start: &Bound<&[u8]>, end: &Bound<&[u8]>) -> bool {
    match (start, end) {
        (Bound::Unbounded, _) | (_, Bound::Unbounded) => false,
        (Bound::Included(s), Bound::Included(e)) => s > e,
        (Bound::Included(s) | Bound::Excluded(s), Bound::Excluded(e))
        | (Bound::Excluded(s), Bound::Included(e)) => s >= e,
    }
}

pub(crate) fn as_ref(bound: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    bound.as_ref().map(Vec::as_slice)
}

pub(crate) fn owned(bound: Bound<&[u8]>) -> Bound<Vec<u8>> {
    bound.map(<[u8]>::to_vec)
}

/// The key of a bound that has one.
fn bound_key<'a>(bound: &Bound<&'a [u8]>) -> Option<&'a [u8]> {
    match bound {
        Bound::Included(k) | Bound::Excluded(k) => Some(k),
        Bound::Unbounded => None,
    }
}

/// Of two bounds, the one that lets fewer keys through on its side: the one
/// whose key compares as `narrower` to the other's (`Greater` for starts, `Less`
/// for ends), or the excluding one of two with the same key.
fn tighter<'a>(
    a: Bound<&'a [u8]>,
    b: Bound<&'a [u8]>,
    narrower: std::cmp::Ordering,
) -> Bound<&'a [u8]> {
    match (bound_key(&a), bound_key(&b)) {
        (None, _) => b,
        (_, None) => a,
        (Some(x), Some(y)) => match x.cmp(y) {
            order if order == narrower => a,
            std::cmp::Ordering::Equal if matches!(a, Bound::Excluded(_)) => a,
            _ => b,
        },
    }
}

/// The greater of two start bounds.
fn later_start<'a>(a: Bound<&'a [u8]>, b: Bound<&'a [u8]>) -> Bound<&'a [u8]> {
    tighter(a, b, std::cmp::Ordering::Greater)
}

/// The lesser of two end bounds.
fn earlier_end<'a>(a: Bound<&'a [u8]>, b: Bound<&'a [u8]>) -> Bound<&'a [u8]> {
    tighter(a, b, std::cmp::Ordering::Less)
}

impl Packing {
    /// A scan's range cut at the packed tables' edges, in ascending order.
    pub(crate) fn segments(&self, start: Bound<&[u8]>, end: Bound<&[u8]>) -> Vec<Segment> {
        let mut segments = Vec::new();
        let mut from: Bound<Vec<u8>> = owned(start);
        for table in &self.tables {
            let (first, past) = ([*table], [*table + 1]);
            let before = earlier_end(end, Bound::Excluded(&first));
            if !is_empty_range(&as_ref(&from), &before) {
                segments.push(Segment::Plain(from.clone(), owned(before)));
            }
            let inside_from = later_start(as_ref(&from), Bound::Included(&first));
            let inside_to = earlier_end(end, Bound::Excluded(&past));
            if !is_empty_range(&inside_from, &inside_to) {
                segments.push(Segment::Packed(owned(inside_from), owned(inside_to)));
            }
            from = owned(later_start(as_ref(&from), Bound::Included(&past)));
        }
        if !is_empty_range(&as_ref(&from), &end) {
            segments.push(Segment::Plain(from, owned(end)));
        }
        segments
    }
}

/// One slice of a packed table: its keys' common prefix (table, scope, entry and
/// its separator) and where its scope ends.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Slice {
    pub(crate) prefix: Vec<u8>,
    pub(crate) scope: usize,
}

/// Slices sort by their prefix alone (the scope's end follows from it), so a set
/// of them is looked up by a prefix without building a `Slice`.
impl std::borrow::Borrow<[u8]> for Slice {
    fn borrow(&self) -> &[u8] {
        &self.prefix
    }
}

impl Slice {
    /// The slice of a packed key, or of a slice prefix itself.
    pub(crate) fn of(key: &[u8]) -> Option<Slice> {
        let (prefix, scope) = slice_of(key)?;
        Some(Slice {
            prefix: prefix.to_vec(),
            scope,
        })
    }

    /// Its key in the slice directory (`SLICE_PREFIX`).
    pub(crate) fn directory_key(&self) -> Vec<u8> {
        [SLICE_PREFIX, &self.prefix].concat()
    }

    pub(crate) fn entry(&self) -> &[u8] {
        &self.prefix[self.scope..self.prefix.len() - 1]
    }

    /// The key of this slice's entry in `row`.
    pub(crate) fn key_in(&self, row: &[u8]) -> Vec<u8> {
        join(&self.prefix, self.scope, row)
    }

    /// The rows to read for this slice's keys between two bounds (`None`: none of
    /// its keys lies between them). Within a slice a key is the slice's prefix and
    /// the row key's tail after the scope, so bounds carry over tail for tail.
    pub(crate) fn row_bounds(&self, start: Bound<&[u8]>, end: Bound<&[u8]>) -> Option<KeyRange> {
        let scope = &self.prefix[..self.scope];
        let carried = |key: &[u8]| {
            let mut row = scope.to_vec();
            row.extend_from_slice(&key[self.prefix.len()..]);
            row
        };
        let scope_end = crate::prefix_end(scope).map_or(Bound::Unbounded, Bound::Excluded);
        let from = match start {
            Bound::Unbounded => Bound::Included(scope.to_vec()),
            Bound::Included(k) if k.starts_with(&self.prefix) => Bound::Included(carried(k)),
            Bound::Excluded(k) if k.starts_with(&self.prefix) => Bound::Excluded(carried(k)),
            // Below the slice: from its first key; above it: nothing.
            Bound::Included(k) | Bound::Excluded(k) if k < self.prefix.as_slice() => {
                Bound::Included(scope.to_vec())
            }
            _ => return None,
        };
        let to = match end {
            Bound::Unbounded => scope_end,
            Bound::Included(k) if k.starts_with(&self.prefix) => Bound::Included(carried(k)),
            Bound::Excluded(k) if k.starts_with(&self.prefix) => Bound::Excluded(carried(k)),
            Bound::Included(k) | Bound::Excluded(k) if k > self.prefix.as_slice() => scope_end,
            _ => return None,
        };
        (!is_empty_range(&as_ref(&from), &as_ref(&to))).then_some((from, to))
    }

    /// Whether any key of this slice could lie between two bounds.
    pub(crate) fn meets(&self, start: Bound<&[u8]>, end: Bound<&[u8]>) -> bool {
        self.row_bounds(start, end).is_some()
    }
}

/// The one slice a range lies in, when its start names a slice and its end does
/// not reach past that slice's keys: the common case (one meter's buckets of one
/// customer, or of all customers), read without finding the slices first.
pub(crate) fn single_slice(start: Bound<&[u8]>, end: Bound<&[u8]>) -> Option<Slice> {
    let (prefix, scope) = slice_of(bound_key(&start)?)?;
    let slice = Slice {
        prefix: prefix.to_vec(),
        scope,
    };
    let past = crate::prefix_end(&slice.prefix)?;
    let within = match end {
        Bound::Unbounded => false,
        Bound::Included(k) => k.starts_with(&slice.prefix) || k < past.as_slice(),
        Bound::Excluded(k) => k.starts_with(&slice.prefix) || k <= past.as_slice(),
    };
    within.then_some(slice)
}

/// Collects the slices of `row` (its entries) into `slices`: how a store that has
/// rows but no slice directory builds one.
pub(crate) fn note_slices(
    row: &[u8],
    value: &[u8],
    slices: &mut std::collections::BTreeSet<Slice>,
) -> Result<(), StoreError> {
    let scope = scope_end(row)
        .ok_or_else(|| StoreError::Corrupt("a packed row key does not decode".to_string()))?;
    for (entry, _) in decode_row(value)? {
        let mut prefix = Vec::with_capacity(scope + entry.len() + 1);
        prefix.extend_from_slice(&row[..scope]);
        prefix.extend_from_slice(entry);
        prefix.push(0);
        slices.insert(Slice { prefix, scope });
    }
    Ok(())
}
