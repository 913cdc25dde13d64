//! Read-ahead advice for sled's data file. A large store is read at random (a
//! void's rows, a rebuild's buckets, a cold query): each node sled reads is a
//! few KiB, but sled reads a page fragment as a header and then its body, two
//! adjacent reads that the kernel takes for the start of a sequential stream and
//! follows with a read-ahead window (up to the device's setting, 8 MiB on some
//! VMs) of pages nobody asked for. On a cold page cache that is most of the bytes
//! read (docs/benchmarks.md, "Read-ahead off for scattered reads"). Advising random access
//! turns read-ahead off for the file. The binary advises once the service has
//! caught up with the log: start-up reads whole ranges, which read-ahead serves.
//!
//! sled opens its file itself and hands out no descriptor, and advice belongs to
//! the open file (not the inode), so advising a file opened anew would not reach
//! sled's reads. Instead the process takes a duplicate of sled's own descriptor
//! (`pidfd_getfd` on itself: the same open file), checks that it is the store's
//! data file, advises it and drops the duplicate. Only advice: a system that
//! refuses any step reads as before.

use std::path::Path;

/// The file of a sled store that holds its pages (sled 0.34 names it so).
pub const SLED_DATA_FILE: &str = "db";

/// Advises random access on the data file of the sled store opened in `dir`, if
/// this process has it open. Returns how many open descriptors of it were
/// advised (sled keeps one), or why none could be.
pub fn advise_random_reads(dir: &Path) -> Result<usize, String> {
    #[cfg(target_os = "linux")]
    {
        linux::advise(&dir.join(SLED_DATA_FILE))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = dir;
        Ok(0)
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    use rustix::fs::{fadvise, fstat, Advice};
    use rustix::process::{getpid, pidfd_getfd, pidfd_open, PidfdFlags, PidfdGetfdFlags};

    /// Where this process lists its open descriptors.
    const OWN_DESCRIPTORS: &str = "/proc/self/fd";

    pub(super) fn advise(data_file: &Path) -> Result<usize, String> {
        let wanted = std::fs::metadata(data_file)
            .map_err(|error| format!("reading {}: {error}", data_file.display()))?;
        let path = std::fs::canonicalize(data_file)
            .map_err(|error| format!("resolving {}: {error}", data_file.display()))?;
        let pidfd = pidfd_open(getpid(), PidfdFlags::empty())
            .map_err(|error| format!("opening a pidfd of this process: {error}"))?;
        let entries = std::fs::read_dir(OWN_DESCRIPTORS)
            .map_err(|error| format!("listing {OWN_DESCRIPTORS}: {error}"))?;
        let mut advised = 0;
        for entry in entries.flatten() {
            // Only descriptors of the data file are duplicated: dropping a
            // duplicate of another file could end a lock that file holds (a POSIX
            // record lock ends on any close; sled and the log use `flock`, which
            // does not).
            if std::fs::read_link(entry.path()).ok().as_deref() != Some(path.as_path()) {
                continue;
            }
            let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            // A descriptor closed since the listing, or one of another file (its
            // number reused meanwhile): the identity check below skips it.
            let Ok(duplicate) = pidfd_getfd(&pidfd, fd, PidfdGetfdFlags::empty()) else {
                continue;
            };
            let Ok(stat) = fstat(&duplicate) else {
                continue;
            };
            if stat.st_dev != wanted.dev() || stat.st_ino != wanted.ino() {
                continue;
            }
            fadvise(&duplicate, 0, None, Advice::Random)
                .map_err(|error| format!("advising random reads: {error}"))?;
            advised += 1;
        }
        Ok(advised)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn the_store_data_file_sled_holds_open_is_advised() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        db.insert(b"k", b"v").unwrap();
        assert_eq!(advise_random_reads(dir.path()), Ok(1));
        drop(db);
        // Closed: nothing of this process holds it any more.
        assert_eq!(advise_random_reads(dir.path()), Ok(0));
    }

    #[test]
    fn a_directory_without_a_store_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let error = advise_random_reads(dir.path()).unwrap_err();
        assert!(error.contains(SLED_DATA_FILE), "{error}");
    }
}
