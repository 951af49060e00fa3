//! `iop bench --cpu NAME=PID,…`: the CPU time and context switches of the processes that
//! serve one target, read from Linux's `/proc` before and after that target's measured
//! rounds and reported per request. Each process counts with all its threads and every
//! process descended from it (a launcher that starts the real server); CPU time is what
//! the scheduler ran them (`/proc/PID/task/TID/schedstat`: user and kernel time, in
//! nanoseconds), switches are voluntary and involuntary context switches. Threads that
//! end between two readings take their counts with them.

use std::collections::HashMap;
use std::time::Duration;

/// Processes whose CPU a target's requests are charged with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watch {
    pub target: String,
    pub pids: Vec<u32>,
}

impl Watch {
    /// `NAME=PID[,PID…]`.
    pub fn parse(arg: &str) -> Result<Self, String> {
        let (target, pids) = arg
            .split_once('=')
            .ok_or_else(|| format!("--cpu {arg:?} must be NAME=PID[,PID...]"))?;
        let pids = pids
            .split(',')
            .map(|p| {
                p.trim()
                    .parse::<u32>()
                    .map_err(|_| format!("--cpu {arg:?}: {p:?} is not a process id"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Watch {
            target: target.to_string(),
            pids,
        })
    }
}

/// What a set of processes used so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub cpu: Duration,
    pub switches: u64,
}

impl Usage {
    /// What was used between `before` and `self`.
    pub fn since(self, before: Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_sub(before.cpu),
            switches: self.switches.saturating_sub(before.switches),
        }
    }
}

/// The processes `pids` and their descendants, now.
pub fn read(pids: &[u32]) -> std::io::Result<Usage> {
    let mut usage = Usage::default();
    for pid in with_descendants(pids)? {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue; // it ended meanwhile
        };
        for task in tasks.flatten() {
            let dir = task.path();
            let ran = std::fs::read_to_string(dir.join("schedstat")).unwrap_or_default();
            if let Some(ns) = ran.split_whitespace().next().and_then(|n| n.parse().ok()) {
                usage.cpu += Duration::from_nanos(ns);
            }
            let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
            usage.switches += switches(&status);
        }
    }
    Ok(usage)
}

/// Voluntary plus involuntary context switches in a `/proc/…/status` text.
fn switches(status: &str) -> u64 {
    status
        .lines()
        .filter(|l| {
            l.starts_with("voluntary_ctxt_switches") || l.starts_with("nonvoluntary_ctxt_switches")
        })
        .filter_map(|l| {
            l.rsplit(|c: char| c.is_whitespace())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// The parent process id in a `/proc/PID/stat` text (the field after the command name,
/// which is in parentheses and may hold spaces and parentheses itself).
fn parent(stat: &str) -> Option<u32> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(1)?.parse().ok()
}

/// `pids` and every living process below them.
fn with_descendants(pids: &[u32]) -> std::io::Result<Vec<u32>> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(ppid) = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .as_deref()
            .and_then(parent)
        {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut all: Vec<u32> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut next: Vec<u32> = pids.to_vec();
    while let Some(pid) = next.pop() {
        if seen.insert(pid) {
            all.push(pid);
            next.extend(children.get(&pid).into_iter().flatten());
        }
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_name_a_target_and_its_processes() {
        assert_eq!(
            Watch::parse("iop=12,34").unwrap(),
            Watch {
                target: "iop".into(),
                pids: vec![12, 34]
            }
        );
        assert!(Watch::parse("iop").is_err());
        assert!(Watch::parse("iop=12,x").is_err());
    }

    #[test]
    fn proc_texts_are_read_as_linux_writes_them() {
        assert_eq!(parent("42 (tokio (rt) x) S 7 42 42 0 -1"), Some(7));
        assert_eq!(
            switches("Name:\tiop\nvoluntary_ctxt_switches:\t10\nnonvoluntary_ctxt_switches:\t3\n"),
            13
        );
    }

    #[test]
    fn this_process_uses_cpu_and_switches() {
        let me = std::process::id();
        let before = read(&[me]).unwrap();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        std::thread::sleep(Duration::from_millis(5));
        let used = read(&[me]).unwrap().since(before);
        assert!(used.cpu > Duration::ZERO, "{used:?}");
        assert!(used.switches > 0, "{used:?}");
    }
}
