//! Reads the log files the kubelet writes for a namespace's containers (`<podLogsDir>/<ns>_<pod>_
//! <uid>/<container>/<restart>.log`, CRI format) while a test runs, and keeps every line that
//! matches a word: `forbidden` for the charts' RBAC (issue 24). Files are polled, not streamed
//! through the API, so a container that restarted or a Pod that was deleted (the kubelet keeps
//! its files until its next container GC, about a minute) is read too.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One matching line: `pod/container` (the Pod's name, not its UID) and the message part of the
/// CRI line (after `<time> <stream> <tag> `).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub container: String,
    pub line: String,
}

impl std::fmt::Display for LogLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.container, self.line)
    }
}

#[derive(Default)]
struct Scan {
    /// Bytes already read of each file (a file shorter than that was rotated: read it again).
    offsets: BTreeMap<PathBuf, u64>,
    /// A line's start kept until its newline arrives.
    partial: BTreeMap<PathBuf, Vec<u8>>,
    found: Vec<LogLine>,
    /// `pod/container` of every log file read, so a caller can tell "nothing matched" from
    /// "nothing was read".
    read: BTreeSet<String>,
}

/// What [`LogWatch::finish`] saw.
#[derive(Debug, Default)]
pub struct Seen {
    pub matching: Vec<LogLine>,
    /// `pod/container` of every container whose log was read.
    pub containers: BTreeSet<String>,
}

/// Polls the log files of namespace `namespace` under `pod_logs` every `every` until
/// [`LogWatch::finish`].
pub struct LogWatch {
    pod_logs: PathBuf,
    namespace: String,
    word: String,
    scan: Arc<Mutex<Scan>>,
    task: tokio::task::JoinHandle<()>,
}

impl LogWatch {
    /// Starts polling; lines already written (from the containers' start) are read first.
    pub fn start(pod_logs: &Path, namespace: &str, word: &str, every: Duration) -> LogWatch {
        let scan = Arc::new(Mutex::new(Scan::default()));
        let (dir, ns, w, s) = (
            pod_logs.to_path_buf(),
            namespace.to_string(),
            word.to_lowercase(),
            scan.clone(),
        );
        let task = tokio::spawn(async move {
            loop {
                sweep(&dir, &ns, &w, &s);
                tokio::time::sleep(every).await;
            }
        });
        LogWatch {
            pod_logs: pod_logs.to_path_buf(),
            namespace: namespace.to_string(),
            word: word.to_lowercase(),
            scan,
            task,
        }
    }

    /// The matching lines read so far (polling goes on).
    pub fn matching(&self) -> Vec<LogLine> {
        sweep(&self.pod_logs, &self.namespace, &self.word, &self.scan);
        let s = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        s.found.clone()
    }

    /// Stops polling, reads what was written since the last poll and returns every matching
    /// line and the containers read.
    pub fn finish(self) -> Seen {
        self.task.abort();
        sweep(&self.pod_logs, &self.namespace, &self.word, &self.scan);
        let s = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        Seen {
            matching: s.found.clone(),
            containers: s.read.clone(),
        }
    }
}

/// `<pod>` of a pod log directory `<ns>_<pod>_<uid>` in namespace `ns`.
fn pod_of<'a>(dir_name: &'a str, ns: &str) -> Option<&'a str> {
    let rest = dir_name.strip_prefix(ns)?.strip_prefix('_')?;
    rest.rsplit_once('_').map(|(pod, _uid)| pod)
}

/// The message of a CRI log line (`<RFC3339 time> <stdout|stderr> <F|P> <message>`).
fn message(line: &str) -> &str {
    line.splitn(4, ' ').nth(3).unwrap_or(line)
}

fn sweep(pod_logs: &Path, ns: &str, word: &str, scan: &Mutex<Scan>) {
    let mut s = scan.lock().unwrap_or_else(|p| p.into_inner());
    let Ok(pods) = std::fs::read_dir(pod_logs) else {
        return;
    };
    for pod_dir in pods.flatten() {
        let name = pod_dir.file_name().to_string_lossy().into_owned();
        let Some(pod) = pod_of(&name, ns) else {
            continue;
        };
        let Ok(containers) = std::fs::read_dir(pod_dir.path()) else {
            continue;
        };
        for c in containers.flatten() {
            let container = format!("{pod}/{}", c.file_name().to_string_lossy());
            let Ok(files) = std::fs::read_dir(c.path()) else {
                continue;
            };
            for f in files.flatten() {
                let path = f.path();
                // Rotated files are compressed (`.gz`); their lines were read before rotation.
                if path.extension().is_some_and(|e| e == "gz") {
                    continue;
                }
                read_new(&mut s, &path, &container, word);
            }
        }
    }
}

fn read_new(s: &mut Scan, path: &Path, container: &str, word: &str) {
    let Ok(mut file) = std::fs::File::open(path) else {
        return;
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut from = s.offsets.get(path).copied().unwrap_or(0);
    s.read.insert(container.to_string());
    if len < from {
        from = 0;
        s.partial.remove(path);
    }
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(from)).is_err() || file.read_to_end(&mut bytes).is_err() {
        return;
    }
    s.offsets
        .insert(path.to_path_buf(), from + bytes.len() as u64);
    let mut buf = s.partial.remove(path).unwrap_or_default();
    buf.extend_from_slice(&bytes);
    let complete = buf.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    let rest = buf.split_off(complete);
    if !rest.is_empty() {
        s.partial.insert(path.to_path_buf(), rest);
    }
    for line in String::from_utf8_lossy(&buf).lines() {
        let msg = message(line);
        if msg.to_lowercase().contains(word) {
            s.found.push(LogLine {
                container: container.to_string(),
                line: msg.to_string(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn pod_name_of_a_log_directory() {
        assert_eq!(
            pod_of(
                "kube-system_harvester-csi-driver-9bn6r_1013b749-fb64",
                "kube-system"
            ),
            Some("harvester-csi-driver-9bn6r")
        );
        assert_eq!(pod_of("default_web_1234", "kube-system"), None);
        assert_eq!(pod_of("kube-systemx_web_1234", "kube-system"), None);
    }

    #[tokio::test]
    async fn matching_lines_are_named_by_pod_and_container_across_appends_and_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let c = dir.path().join("kube-system_snap-1_uid-1/csi-snapshotter");
        std::fs::create_dir_all(&c).unwrap();
        std::fs::create_dir_all(dir.path().join("default_app_uid-2/app")).unwrap();
        let log = c.join("0.log");
        std::fs::write(
            &log,
            "2026-12-01T18:48:22Z stderr F I1201 started\n2026-12-01T18:48:23Z stderr F E1201 x is Forb",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("default_app_uid-2/app/0.log"),
            "2026-12-01T18:48:22Z stdout F forbidden but not in the namespace\n",
        )
        .unwrap();
        let watch = LogWatch::start(
            dir.path(),
            "kube-system",
            "forbidden",
            Duration::from_secs(3600),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        // the rest of the half-written line arrives after the first poll
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        f.write_all(b"idden: cannot watch\n").unwrap();
        drop(f);
        let seen = watch.finish();
        assert_eq!(
            seen.containers,
            BTreeSet::from(["snap-1/csi-snapshotter".to_string()]),
            "only the namespace's files"
        );
        assert_eq!(
            seen.matching,
            vec![LogLine {
                container: "snap-1/csi-snapshotter".into(),
                line: "E1201 x is Forbidden: cannot watch".into(),
            }]
        );

        // a rotated (truncated) file is read from its start again
        let watch = LogWatch::start(
            dir.path(),
            "kube-system",
            "forbidden",
            Duration::from_millis(5),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        std::fs::write(&log, "2026-12-01T18:49:00Z stderr F forbidden again\n").unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let seen = watch.finish();
        assert_eq!(
            seen.matching.last().map(|l| l.line.as_str()),
            Some("forbidden again")
        );
    }
}
