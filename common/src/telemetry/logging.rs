//! Logging through `tracing`, as text or JSON (`--log-format`), filtered by `RUST_LOG`.

use std::str::FromStr;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("--log-format {other:?}: must be text or json")),
        }
    }
}

/// Installs the global subscriber, writing to stderr; `default_filter` applies when `RUST_LOG` is unset.
/// A second call (tests) is a no-op.
pub fn init_logging(format: LogFormat, default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    use std::io::IsTerminal;
    // Colour codes only for a person at a terminal: `kubectl logs` and files show them raw.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_formats_and_names_bad_values() {
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        let err = "yaml".parse::<LogFormat>().unwrap_err();
        assert!(
            err.contains("--log-format") && err.contains("yaml"),
            "{err}"
        );
    }
}
