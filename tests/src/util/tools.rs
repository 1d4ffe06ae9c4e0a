//! Where the bed finds its Go tools: built by `tests/scripts/tools.sh` into a version-keyed cache.

use std::path::PathBuf;
use std::process::Command;

use crate::BedError;

/// The tool directory: `$HARVESTER_TESTBED_TOOLS`, or what `tools.sh --print-dir` names.
pub fn tools_dir() -> Result<PathBuf, BedError> {
    print_dir("HARVESTER_TESTBED_TOOLS", &script())
}

/// `$env` if set, else what `bash <script> --print-dir` prints (a version-keyed cache directory).
pub fn print_dir(env: &str, script: &std::path::Path) -> Result<PathBuf, BedError> {
    if let Some(dir) = std::env::var_os(env) {
        return Ok(PathBuf::from(dir));
    }
    let out = Command::new("bash")
        .arg(script)
        .arg("--print-dir")
        .output()
        .map_err(|e| BedError::Setup(format!("running {} --print-dir: {e}", script.display())))?;
    if !out.status.success() {
        return Err(BedError::Setup(format!(
            "{} --print-dir failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(PathBuf::from(
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    ))
}

/// The path of one tool, or an error saying how to build it.
pub fn tool(name: &str) -> Result<PathBuf, BedError> {
    tool_in(&tools_dir()?, name)
}

/// The path of tool `name` in `dir`, or an error saying how to build it.
pub fn tool_in(dir: &std::path::Path, name: &str) -> Result<PathBuf, BedError> {
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(BedError::MissingTool {
            tool: name.to_string(),
            path,
            script: script(),
        })
    }
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/tools.sh")
}
