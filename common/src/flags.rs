//! Command lines the way the upstream Go programs parse them, so that whatever a user or a chart
//! passed to upstream keeps working: flag spellings ([`normalize_args`]), Go's value syntaxes
//! ([`GoType`]), and errors that are one line naming the flag and the value ([`parse`]).
//!
//! - The cloud provider is a cobra/pflag program (k8s.io/cloud-provider): `--name=value` or
//!   `--name value`, a bool bare or `--name=true|false` (never `--name false`), a repeated flag
//!   keeps its last value (slices append), and `_` in a name is read as `-`
//!   (`cliflag.WordSepNormalizeFunc`).
//! - The CSI driver is a urfave/cli v1 program over Go's `flag` package: the same, plus a single
//!   dash (`-endpoint=...`) and no `_` normalisation.

use std::error::Error as _;
use std::ffi::OsString;
use std::time::Duration;

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// Which Go flag parser the upstream program used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syntax {
    /// spf13/pflag with `WordSepNormalizeFunc` (cobra programs such as the cloud provider).
    Pflag,
    /// Go's `flag` package (urfave/cli v1 programs such as the CSI driver).
    GoFlag,
}

/// Rewrites a command line (program name first) into the spelling clap parses: `_` in pflag
/// names becomes `-`; a Go-flag `-name` becomes `--name`. Stops at `--`; values are untouched.
pub fn normalize_args<I, T>(args: I, syntax: Syntax) -> Vec<OsString>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let mut out = Vec::new();
    let mut flags_done = false;
    for (i, arg) in args.into_iter().map(Into::into).enumerate() {
        if i == 0 || flags_done {
            out.push(arg);
            continue;
        }
        if arg == "--" {
            flags_done = true;
            out.push(arg);
            continue;
        }
        out.push(normalize_one(arg, syntax));
    }
    out
}

fn normalize_one(arg: OsString, syntax: Syntax) -> OsString {
    // Non-UTF-8 arguments are values (or garbage clap reports); leave them alone.
    let Some(s) = arg.to_str() else { return arg };
    let body = match (s.strip_prefix("--"), syntax) {
        (Some(body), _) => body,
        (None, Syntax::GoFlag) => match s.strip_prefix('-') {
            // `-x` stays a short flag; Go has none, but `-h` and `-v` are urfave's.
            Some(body) if body.chars().count() > 1 && !body.starts_with('=') => body,
            _ => return arg,
        },
        (None, Syntax::Pflag) => return arg,
    };
    if body.is_empty() {
        return arg;
    }
    let (name, value) = match body.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (body, None),
    };
    let name = match syntax {
        Syntax::Pflag => name.replace('_', "-"),
        Syntax::GoFlag => name.to_string(),
    };
    let mut out = format!("--{name}");
    if let Some(v) = value {
        out.push('=');
        out.push_str(v);
    }
    OsString::from(out)
}

/// Makes every flag that takes a separate value take the next argument even when it starts with
/// `-`, as pflag and Go's flag package do (`--controllers -route` is the value `-route`).
pub fn take_hyphen_values(command: clap::Command) -> clap::Command {
    command.mut_args(|a| {
        if a.get_action().takes_values() && !a.is_require_equals_set() {
            a.allow_hyphen_values(true)
        } else {
            a
        }
    })
}

/// A bool as Go's `strconv.ParseBool` reads it.
pub fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(format!("{s:?} is not a bool (true or false)")),
    }
}

/// A Go duration: `300ms`, `30s`, `5m`, `1h30m`, `1.5h`, `0`.
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err("empty duration".into());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_len);
        let value: f64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a duration like 30s, 5m or 1h30m"))?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let seconds = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "" => return Err(format!("{s:?} lacks a unit (ns, us, ms, s, m, h)")),
            other => return Err(format!("unknown unit {other:?} in {s:?}")),
        };
        total += value * seconds;
        rest = next;
    }
    Duration::try_from_secs_f64(total).map_err(|e| format!("{s:?}: {e}"))
}

/// The value types of upstream's flags (pflag's `Value.Type()` names), for flags that are
/// accepted without effect here but must still be given a value upstream would have taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoType {
    Bool,
    String,
    /// A list of strings (`stringSlice`, `strings`, comma-separated, repeat appends).
    StringSlice,
    Int,
    Int32,
    Uint32,
    Float32,
    Duration,
    Ip,
    /// `key=bool,key=bool` (`mapStringBool`, e.g. `--feature-gates`).
    MapStringBool,
    /// `key=value,key=value` (`mapStringString`).
    MapStringString,
    /// `cert,key[:name,name]` (`namedCertKey`).
    NamedCertKey,
    /// `--version`: `true`, `false`, `raw` (component-base verflag).
    Version,
    /// A Kubernetes quantity (`quantity`, e.g. `--log-text-info-buffer-size=64Ki`).
    Quantity,
    /// klog's `--vmodule`: `pattern=N,...`.
    ModuleSpec,
}

impl GoType {
    /// Parses pflag's `Value.Type()` name.
    pub fn from_pflag(name: &str) -> Option<GoType> {
        Some(match name {
            "bool" => GoType::Bool,
            "string" => GoType::String,
            "stringSlice" | "strings" => GoType::StringSlice,
            "int" => GoType::Int,
            "int32" => GoType::Int32,
            "uint32" | "Level" => GoType::Uint32,
            "float32" => GoType::Float32,
            "duration" => GoType::Duration,
            "ip" => GoType::Ip,
            "mapStringBool" => GoType::MapStringBool,
            "mapStringString" => GoType::MapStringString,
            "namedCertKey" => GoType::NamedCertKey,
            "version" => GoType::Version,
            "quantity" => GoType::Quantity,
            "pattern=N,..." | "moduleSpec" => GoType::ModuleSpec,
            _ => return None,
        })
    }

    /// Checks that `value` is one upstream's parser would have taken.
    pub fn check(self, value: &str) -> Result<(), String> {
        let int = |bits: u32| -> Result<(), String> {
            let n = parse_go_int(value)?;
            let (min, max) = (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1);
            if (min..=max).contains(&i128::from(n)) {
                Ok(())
            } else {
                Err(format!(
                    "{value:?} is out of range for a {bits}-bit integer"
                ))
            }
        };
        match self {
            GoType::Bool => parse_go_bool(value).map(drop),
            GoType::String | GoType::StringSlice => Ok(()),
            GoType::Int => int(64),
            GoType::Int32 => int(32),
            GoType::Uint32 => {
                let n = parse_go_int(value)?;
                u32::try_from(n)
                    .map(drop)
                    .map_err(|_| format!("{value:?} is not an unsigned 32-bit integer"))
            }
            GoType::Float32 => value
                .trim()
                .parse::<f32>()
                .map(drop)
                .map_err(|_| format!("{value:?} is not a number")),
            GoType::Duration => parse_go_duration(value.trim_start_matches('-')).map(drop),
            GoType::Ip => value
                .trim()
                .parse::<std::net::IpAddr>()
                .map(drop)
                .map_err(|_| format!("{value:?} is not an IP address")),
            GoType::MapStringBool => pairs(value, |k, v| {
                parse_go_bool(v.trim())
                    .map(drop)
                    .map_err(|e| format!("{k}: {e}"))
            }),
            GoType::MapStringString => pairs(value, |_, _| Ok(())),
            GoType::NamedCertKey => {
                let files = value.split(':').next().unwrap_or_default();
                match files.split(',').collect::<Vec<_>>().as_slice() {
                    [cert, key] if !cert.is_empty() && !key.is_empty() => Ok(()),
                    _ => Err(format!("{value:?} is not certfile,keyfile[:name,...]")),
                }
            }
            GoType::Version => match value {
                "raw" => Ok(()),
                v => parse_go_bool(v).map(drop),
            },
            GoType::Quantity => crate::quantity::to_bytes(value.trim())
                .map(drop)
                .ok_or_else(|| format!("{value:?} is not a quantity like 64Ki or 1M")),
            GoType::ModuleSpec => pairs(value, |k, v| {
                v.trim()
                    .parse::<u32>()
                    .map(drop)
                    .map_err(|_| format!("{k}: {v:?} is not a verbosity level"))
            }),
        }
    }
}

/// An integer as `strconv.ParseInt(s, 0, 64)` reads it (`0x`, `0o`, `0b` and leading-`0`
/// octal prefixes, `_` separators after a prefix).
fn parse_go_int(value: &str) -> Result<i64, String> {
    let bad = || format!("{value:?} is not an integer");
    let (neg, digits) = match value.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, value.strip_prefix('+').unwrap_or(value)),
    };
    let lower = digits.to_ascii_lowercase();
    let (radix, body) = if let Some(b) = lower.strip_prefix("0x") {
        (16, b.replace('_', ""))
    } else if let Some(b) = lower.strip_prefix("0o") {
        (8, b.replace('_', ""))
    } else if let Some(b) = lower.strip_prefix("0b") {
        (2, b.replace('_', ""))
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, lower[1..].replace('_', ""))
    } else {
        (10, lower.clone())
    };
    if body.is_empty() || body.starts_with(['+', '-']) {
        return Err(bad());
    }
    let n = i64::from_str_radix(&body, radix).map_err(|_| bad())?;
    Ok(if neg { -n } else { n })
}

fn pairs(value: &str, each: impl Fn(&str, &str) -> Result<(), String>) -> Result<(), String> {
    for item in value.split(',').filter(|s| !s.trim().is_empty()) {
        let Some((k, v)) = item.split_once('=') else {
            return Err(format!("{item:?} is not key=value"));
        };
        each(k.trim(), v)?;
    }
    Ok(())
}

/// Why a command line was refused; `code` is the exit code (2, as pflag and clap use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// `--help` or `--version`: print `text` to stdout and exit 0.
    Print(String),
    /// A bad command line: print `line` (one line naming the flag and the value), exit 2.
    Refused(String),
}

/// One line for a clap error: which flag, which value, why; or the text of `--help`/`--version`.
pub fn clap_outcome(e: &clap::Error) -> Outcome {
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        return Outcome::Print(e.render().to_string());
    }
    let ctx = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        Some(ContextValue::Strings(v)) => Some(v.join(", ")),
        _ => None,
    };
    // The flag as the user wrote it: clap's "--name <NAME>" placeholder is dropped.
    let arg = ctx(ContextKind::InvalidArg)
        .map(|a| a.split([' ', '=']).next().unwrap_or_default().to_string());
    let line = match (e.kind(), arg, ctx(ContextKind::InvalidValue)) {
        (ErrorKind::UnknownArgument, Some(a), _) => format!("unknown flag: {a}"),
        (ErrorKind::InvalidValue | ErrorKind::ValueValidation, Some(a), Some(v)) => {
            let why = e.source().map(|s| format!(": {s}")).unwrap_or_default();
            format!("invalid value {v:?} for {a}{why}")
        }
        _ => {
            // Anything else: clap's own first line, without its "error: " prefix.
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            first.trim_start_matches("error: ").to_string()
        }
    };
    Outcome::Refused(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(args: &[&str], syntax: Syntax) -> Vec<String> {
        let mut all = vec!["prog"];
        all.extend_from_slice(args);
        normalize_args(all, syntax)
            .into_iter()
            .skip(1)
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn pflag_reads_underscores_as_dashes_in_names_only() {
        assert_eq!(
            norm(
                &["--cluster_name=a_b", "--leader_elect", "x_y", "-v", "--"],
                Syntax::Pflag
            ),
            ["--cluster-name=a_b", "--leader-elect", "x_y", "-v", "--"]
        );
        assert_eq!(norm(&["--", "--a_b"], Syntax::Pflag), ["--", "--a_b"]);
    }

    #[test]
    fn go_flag_takes_a_single_dash() {
        assert_eq!(
            norm(
                &[
                    "-endpoint=unix:///x",
                    "-debug",
                    "-h",
                    "--nodeid",
                    "n_1",
                    "-",
                    "-=x"
                ],
                Syntax::GoFlag
            ),
            [
                "--endpoint=unix:///x",
                "--debug",
                "-h",
                "--nodeid",
                "n_1",
                "-",
                "-=x"
            ]
        );
        // Go's flag package does not normalise underscores.
        assert_eq!(
            norm(&["--host_storage_class=x"], Syntax::GoFlag),
            ["--host_storage_class=x"]
        );
    }

    #[test]
    fn go_bools_as_strconv_parse_bool() {
        for t in ["1", "t", "T", "true", "TRUE", "True"] {
            assert_eq!(parse_go_bool(t), Ok(true), "{t}");
        }
        for f in ["0", "f", "F", "false", "FALSE", "False"] {
            assert_eq!(parse_go_bool(f), Ok(false), "{f}");
        }
        for bad in ["yes", "", "tRuE", "2"] {
            assert!(parse_go_bool(bad).unwrap_err().contains(bad), "{bad}");
        }
    }

    #[test]
    fn go_ints_as_strconv_parse_int_base_0() {
        for (s, n) in [
            ("10", 10),
            ("-3", -3),
            ("0x1f", 31),
            ("010", 8),
            ("0b11", 3),
            ("0o17", 15),
            ("0", 0),
        ] {
            assert_eq!(parse_go_int(s), Ok(n), "{s}");
        }
        for bad in ["", "x", "1.5", "--1", "0x"] {
            assert!(parse_go_int(bad).is_err(), "{bad}");
        }
        assert!(GoType::Int32.check("2147483648").is_err());
        assert!(GoType::Int32.check("2147483647").is_ok());
        assert!(GoType::Uint32.check("-1").is_err());
    }

    #[test]
    fn go_types_take_what_upstream_takes() {
        let ok = [
            (GoType::Duration, "1m30s"),
            (GoType::Ip, "0.0.0.0"),
            (GoType::Ip, "::"),
            (GoType::MapStringBool, "A=true,B=false"),
            (GoType::MapStringString, "a=b,c="),
            (GoType::NamedCertKey, "c.pem,k.pem:example.com"),
            (GoType::Float32, "20"),
            (GoType::Version, "raw"),
            (GoType::Quantity, "64Ki"),
            (GoType::ModuleSpec, "node*=4,service=2"),
        ];
        for (t, v) in ok {
            assert_eq!(t.check(v), Ok(()), "{t:?} {v}");
        }
        let bad = [
            (GoType::Duration, "5"),
            (GoType::Ip, "host"),
            (GoType::MapStringBool, "A=yes"),
            (GoType::MapStringString, "a"),
            (GoType::NamedCertKey, "c.pem"),
            (GoType::Float32, "fast"),
            (GoType::Bool, "yes"),
            (GoType::Quantity, "lots"),
            (GoType::ModuleSpec, "node=high"),
        ];
        for (t, v) in bad {
            assert!(t.check(v).is_err(), "{t:?} {v}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_go_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_go_duration("300ms"), Ok(Duration::from_millis(300)));
        assert!(parse_go_duration("5").is_err());
    }
}
