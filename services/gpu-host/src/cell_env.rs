//! The environment cells run with: an allow-list of the host's, never all of it.
//! A cell is not trusted (docs/security.md): it must not read the services'
//! credentials (the object store's keys, NATS' address and credentials) or the
//! platform's settings. Zygotes start with this environment, so every worker
//! forked from them has it; a worker adds only its device and session variables.

use std::collections::BTreeMap;

/// Variables a cell sees as the host has them.
const NAMES: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "TERM",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "MPLCONFIGDIR",
    "PYTHONHASHSEED",
    // the worker runtime's own hooks (not secrets)
    "LOOSELEAF_PROTOCOL_FILE",
    "LOOSELEAF_CUDA_PROBE",
];

/// Families of variables a cell sees: locale, the GPU runtime, math libraries'
/// threads, pip's configuration (`%pip install`), XDG directories.
const PREFIXES: &[&str] = &["LC_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "OPENBLAS_", "PIP_", "XDG_"];

/// The environment for cells: of `host`'s variables, those on the allow-list and
/// those the operator named in `extra`.
pub fn cell_env(host: impl IntoIterator<Item = (String, String)>, extra: &[String]) -> BTreeMap<String, String> {
    host.into_iter()
        .filter(|(k, _)| {
            NAMES.contains(&k.as_str()) || PREFIXES.iter().any(|p| k.starts_with(p)) || extra.iter().any(|e| e == k)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_and_platform_settings_stay_out_and_the_allow_list_passes() {
        let host = [
            ("PATH", "/usr/bin"),
            ("LC_ALL", "C.UTF-8"),
            ("CUDA_HOME", "/usr/local/cuda"),
            ("AWS_SECRET_ACCESS_KEY", "secret"),
            ("AWS_ACCESS_KEY_ID", "key"),
            ("LOOSELEAF_NATS_URL", "nats://127.0.0.1:4222"),
            ("LOOSELEAF_STORE_URL", "s3://bucket"),
            ("NATS_CREDS", "/etc/nats.creds"),
            ("HF_TOKEN", "hf"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let env = cell_env(host, &["HF_TOKEN".to_string()]);
        let names: Vec<&str> = env.keys().map(String::as_str).collect();
        assert_eq!(names, ["CUDA_HOME", "HF_TOKEN", "LC_ALL", "PATH"]);
    }
}
