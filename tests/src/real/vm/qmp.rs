//! QMP (QEMU's machine protocol) and the qemu-guest-agent protocol: JSON lines over a unix socket.
//! One command at a time; events that arrive while waiting for a reply are kept for
//! [`Qmp::take_events`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use crate::BedError;

/// How long one command may take to be answered.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("{socket}: {action}: {source}")]
    Io {
        socket: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{socket}: no reply to {command} within {REPLY_TIMEOUT:?}")]
    Timeout { socket: PathBuf, command: String },
    #[error("{socket}: closed while waiting for the reply to {command}")]
    Closed { socket: PathBuf, command: String },
    #[error("{socket}: {command} failed: {class}: {desc}")]
    Command {
        socket: PathBuf,
        command: String,
        class: String,
        desc: String,
    },
    #[error("{socket}: unreadable line {line:?}: {source}")]
    Json {
        socket: PathBuf,
        line: String,
        #[source]
        source: serde_json::Error,
    },
}

impl From<QmpError> for BedError {
    fn from(e: QmpError) -> Self {
        BedError::Setup(format!("QMP: {e}"))
    }
}

/// One JSON-lines connection (QMP or the guest agent).
pub struct Qmp {
    socket: PathBuf,
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    events: Vec<Value>,
}

impl Qmp {
    /// Connects to QEMU's QMP socket and leaves capabilities negotiation mode.
    pub async fn connect(socket: &Path) -> Result<Qmp, QmpError> {
        let mut q = Qmp::open(socket).await?;
        // The greeting: {"QMP": {...}}.
        q.read_line("the greeting").await?;
        q.execute("qmp_capabilities", json!({})).await?;
        Ok(q)
    }

    /// Connects to qemu-guest-agent's chardev socket and synchronises with `guest-sync`, so a
    /// reply left over from an earlier connection is not taken for ours.
    pub async fn connect_agent(socket: &Path) -> Result<Qmp, QmpError> {
        let mut q = Qmp::open(socket).await?;
        let id = (u64::from(std::process::id()) << 16) | u64::from(rand_u16());
        let reply = q.execute("guest-sync", json!({"id": id})).await?;
        if reply != json!(id) {
            // A stale reply of an earlier guest-sync: read on until ours.
            loop {
                let v = q.read_line("guest-sync").await?;
                if v.get("return") == Some(&json!(id)) {
                    break;
                }
            }
        }
        Ok(q)
    }

    async fn open(socket: &Path) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|source| QmpError::Io {
                socket: socket.to_path_buf(),
                action: "connecting",
                source,
            })?;
        let (r, w) = stream.into_split();
        Ok(Qmp {
            socket: socket.to_path_buf(),
            reader: BufReader::new(r),
            writer: w,
            events: Vec::new(),
        })
    }

    async fn read_line(&mut self, command: &str) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = tokio::time::timeout(REPLY_TIMEOUT, self.reader.read_line(&mut line))
            .await
            .map_err(|_| QmpError::Timeout {
                socket: self.socket.clone(),
                command: command.to_string(),
            })?
            .map_err(|source| QmpError::Io {
                socket: self.socket.clone(),
                action: "reading",
                source,
            })?;
        if n == 0 {
            return Err(QmpError::Closed {
                socket: self.socket.clone(),
                command: command.to_string(),
            });
        }
        serde_json::from_str(line.trim()).map_err(|source| QmpError::Json {
            socket: self.socket.clone(),
            line: line.trim().to_string(),
            source,
        })
    }

    /// Runs `command` and returns its `return` value; an `error` reply is an error naming the
    /// command, its class and description.
    pub async fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let mut msg = json!({"execute": command});
        if arguments.as_object().is_some_and(|a| !a.is_empty()) {
            msg["arguments"] = arguments;
        }
        let mut text = msg.to_string();
        text.push('\n');
        self.writer
            .write_all(text.as_bytes())
            .await
            .map_err(|source| QmpError::Io {
                socket: self.socket.clone(),
                action: "writing",
                source,
            })?;
        loop {
            let v = self.read_line(command).await?;
            if v.get("event").is_some() {
                self.events.push(v);
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    socket: self.socket.clone(),
                    command: command.to_string(),
                    class: e["class"].as_str().unwrap_or_default().to_string(),
                    desc: e["desc"].as_str().unwrap_or_default().to_string(),
                });
            }
            // Anything else (a greeting after a reconnect) is not a reply: read on.
        }
    }

    /// The events received so far (and forgets them).
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.events)
    }
}

fn rand_u16() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or_default(),
    );
    h.finish() as u16
}
