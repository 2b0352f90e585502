//! The Jupyter messages themselves: building a reply or iopub message from its
//! content, reading a verified message's parts back into a message, and the
//! content of the `kernel_info_reply` (the protocol version, `language_info`).

use std::path::Path;

use anyhow::Context as _;
use jupyter_protocol::{JupyterMessage, JupyterMessageContent};
use jupyter_zmq_client as zmq;
use serde_json::{json, Value};

/// The protocol version the kernel speaks.
const PROTOCOL_VERSION: &str = "5.3";

/// The Python version of `python`, for `language_info` ("3" if it cannot be run).
pub(super) fn python_version(python: &Path) -> String {
    let out = std::process::Command::new(python)
        .args(["-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"])
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => "3".into(),
    }
}

/// The content of a `kernel_info_reply`, for cells run by Python `language_version`.
pub(super) fn kernel_info(language_version: &str) -> Value {
    json!({
        "status": "ok",
        "protocol_version": PROTOCOL_VERSION,
        "implementation": "looseleaf",
        "implementation_version": env!("CARGO_PKG_VERSION"),
        "language_info": {
            "name": "python",
            "version": language_version,
            "mimetype": "text/x-python",
            "file_extension": ".py",
            "pygments_lexer": "ipython3",
            "codemirror_mode": { "name": "ipython", "version": 3 },
            "nbconvert_exporter": "python",
        },
        "banner": format!("LooseLeaf {}: IPython cells on serverless GPUs", env!("CARGO_PKG_VERSION")),
        "help_links": [],
        "debugger": false,
    })
}

/// A verified message's parts as a message; content that does not parse as its
/// type is kept as it came.
pub(super) fn parse_raw(raw: zmq::RawMessage) -> anyhow::Result<JupyterMessage> {
    let [header, parent, metadata, content, buffers @ ..] = raw.jparts.as_slice() else {
        anyhow::bail!("a message of {} parts (at least 4 are needed)", raw.jparts.len());
    };
    let header: jupyter_protocol::Header = serde_json::from_slice(header).context("its header")?;
    let content: Value = serde_json::from_slice(content).context("its content is not JSON")?;
    let content = JupyterMessageContent::from_type_and_content(&header.msg_type, content.clone()).unwrap_or_else(|e| {
        tracing::debug!(msg_type = %header.msg_type, error = %e, "content that does not parse as its type; kept as it came");
        JupyterMessageContent::UnknownMessage(jupyter_protocol::UnknownMessage {
            msg_type: header.msg_type.clone(),
            content,
        })
    });
    Ok(JupyterMessage {
        zmq_identities: raw.zmq_identities,
        header,
        parent_header: serde_json::from_slice(parent).ok(),
        metadata: serde_json::from_slice(metadata).unwrap_or_else(|_| json!({})),
        content,
        buffers: buffers.to_vec(),
        channel: None,
    })
}

/// A reply or iopub message of `msg_type` with `content`, child of `parent`. The
/// content goes out exactly as given (the worker's outputs are already Jupyter's
/// own messages; a typed round trip would add `null` fields the spec forbids).
pub(super) fn message(msg_type: &str, content: Value, parent: &JupyterMessage) -> anyhow::Result<JupyterMessage> {
    anyhow::ensure!(content.is_object(), "a {msg_type} message's content must be a JSON object");
    let content = JupyterMessageContent::UnknownMessage(jupyter_protocol::UnknownMessage {
        msg_type: msg_type.to_string(),
        content,
    });
    Ok(JupyterMessage::new(content, Some(parent)))
}
