//! The process's memory mappings (`/proc/self/maps`): which mapping holds an address range,
//! and whether it is writable (registration with `LOCAL_WRITE` needs writable pages).

use std::ops::Range;

/// A run of contiguous, readable mappings with the same writability.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mapping {
    pub(super) range: Range<u64>,
    pub(super) writable: bool,
    /// Whether it is a kernel pseudo-mapping such as `[heap]` or `[stack]`.
    pub(super) special: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Line {
    range: Range<u64>,
    readable: bool,
    writable: bool,
    special: bool,
}

fn parse_line(line: &str) -> Option<Line> {
    let mut fields = line.split_whitespace();
    let (lo, hi) = fields.next()?.split_once('-')?;
    let perms = fields.next()?.as_bytes();
    let path = fields.nth(3).unwrap_or("");
    Some(Line {
        range: u64::from_str_radix(lo, 16).ok()?..u64::from_str_radix(hi, 16).ok()?,
        readable: perms.first() == Some(&b'r'),
        writable: perms.get(1) == Some(&b'w'),
        special: path.starts_with('['),
    })
}

/// The run of mappings in `maps` (the text of `/proc/self/maps`) that contains all of
/// `[start, end)`, if one does.
pub(super) fn find_in(maps: &str, start: u64, end: u64) -> Option<Mapping> {
    let mut run: Option<Mapping> = None;
    for line in maps.lines().filter_map(parse_line) {
        match run.as_mut() {
            None if line.range.contains(&start) && line.readable => {
                run = Some(Mapping {
                    range: line.range,
                    writable: line.writable,
                    special: line.special,
                });
            }
            None => continue,
            Some(r)
                if line.range.start == r.range.end
                    && line.readable
                    && line.writable == r.writable
                    && line.special == r.special =>
            {
                r.range.end = line.range.end;
            }
            Some(_) => break,
        }
    }
    run.filter(|r| r.range.end >= end)
}

/// The run of this process's mappings containing `[start, end)`.
pub(super) fn find(start: u64, end: u64) -> Option<Mapping> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    find_in(&maps, start, end)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/dbus-daemon
00651000-00652000 r--p 00051000 08:02 173521      /usr/bin/dbus-daemon
00652000-00655000 rw-p 00052000 08:02 173521      /usr/bin/dbus-daemon
00e03000-00e24000 rw-p 00000000 00:00 0           [heap]
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000100000-7f0000200000 rw-p 00000000 00:00 0
7f0000200000-7f0000300000 ---p 00000000 00:00 0
7fff00000000-7fff00001000 r--p 00000000 08:02 1 /data/file
";

    #[test]
    fn finds_runs_and_writability() {
        let m = find_in(MAPS, 0x7f0000000010, 0x7f0000000020).unwrap();
        assert_eq!(m.range, 0x7f0000000000..0x7f0000200000, "contiguous rw run");
        assert!(m.writable && !m.special);
        let m = find_in(MAPS, 0x7fff00000000, 0x7fff00000100).unwrap();
        assert!(!m.writable, "read-only file mapping");
        assert!(find_in(MAPS, 0x00e03000, 0x00e04000).unwrap().special);
        assert_eq!(
            find_in(MAPS, 0x7f0000250000, 0x7f0000250001),
            None,
            "PROT_NONE"
        );
        assert_eq!(
            find_in(MAPS, 0x7f00001f0000, 0x7f0000210000),
            None,
            "runs into PROT_NONE"
        );
        assert_eq!(find_in(MAPS, 0x10, 0x20), None, "unmapped");
    }

    #[test]
    fn sees_own_heap_allocation() {
        let v = vec![1u8; 1 << 20];
        let start = v.as_ptr() as u64;
        let m = find(start, start + v.len() as u64).expect("a Vec is mapped");
        assert!(m.writable);
    }
}
