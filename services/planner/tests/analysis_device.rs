//! Device hints: static GPU signs, positive and negative, and the torch corpus.

use looseleaf_planner::analysis::{analyze, Device};

#[track_caller]
fn gpu(code: &str, reason: &str) {
    let hint = analyze(code).device;
    assert_eq!(hint.as_ref().map(|h| h.label), Some(Device::Gpu), "{code:?}");
    let got = hint.map(|h| h.reason).unwrap_or_default();
    assert_eq!(got, reason, "{code:?}");
}

#[track_caller]
fn none(code: &str) {
    assert_eq!(analyze(code).device, None, "{code:?}");
}

#[test]
fn positive_signs() {
    gpu("m = model.cuda()", ".cuda() call at line 1");
    gpu("x = 1\nx = x.to(device)", ".to(device) call at line 2");
    gpu("t = t.to('cuda:0')", ".to(device) call at line 1");
    gpu("t = t.to(torch.device('cuda'))", ".to(device) call at line 1");
    gpu("t = t.to(dev)", ".to(device) call at line 1");
    gpu("t = t.to(cfg.device)", ".to(device) call at line 1");
    gpu("t = t.to(dtype=torch.half, device=my_device)", ".to(device) call at line 1");
    gpu("z = torch.zeros(3, device='cuda')", "device= keyword argument at line 1");
    gpu("z = torch.randn(3, device = device)", "device= keyword argument at line 1");
    gpu("torch.cuda.manual_seed(0)", "torch.cuda.manual_seed at line 1");
    gpu("torch.cuda.synchronize()", "torch.cuda.synchronize at line 1");
    gpu("import cupy as cp\na = cp.arange(10)", "cupy usage (cp) at line 2");
    gpu("import jax\ny = jax.device_put(x)", "jax.device_put at line 2");
    gpu("fast = torch.compile(model)", "torch.compile at line 1");
    // signs inside function bodies count: the cell defines GPU work
    gpu("def step(b):\n    return b.cuda()", ".cuda() call at line 2");
    // signs inside a magic report the magic's line
    gpu("x = 1\n%time y = x.cuda()", ".cuda() call at line 2");
}

#[test]
fn negative_signs() {
    none("device = \"cuda\" if torch.cuda.is_available() else \"cpu\"");
    none("n = torch.cuda.device_count()\nname = torch.cuda.get_device_name(0)");
    none("t = t.to('cpu')\nu = u.to(torch.float32)");
    none("z = torch.zeros(3, device='cpu')");
    none("a = cp.arange(10)"); // cupy not imported here
    none("import matplotlib.pyplot as plt\nplt.plot(x, y)");
    none("y = t.cpu().numpy()");
}

fn corpus_cells(file: &str) -> Vec<String> {
    let path = format!("{}/../../../shared/corpus/torch/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let nb: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    let cells = nb["cells"].as_array().cloned().unwrap_or_default();
    cells
        .iter()
        .filter(|c| c["cell_type"] == "code")
        .map(|c| match &c["source"] {
            serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect(),
            serde_json::Value::String(s) => s.clone(),
            _ => String::new(),
        })
        .collect()
}

fn cell_with<'c>(cells: &'c [String], needle: &str) -> &'c str {
    cells.iter().find(|c| c.contains(needle)).unwrap_or_else(|| panic!("no cell contains {needle:?}"))
}

#[test]
fn pytorch_workflow_notebook() {
    let cells = corpus_cells("mrdbourke_01_pytorch_workflow.ipynb");
    assert!(cells.len() > 30);
    // Moving data and the model to `device` needs the GPU.
    let to_device = cell_with(&cells, "X_train = X_train.to(device)");
    assert_eq!(analyze(to_device).device.map(|d| d.label), Some(Device::Gpu));
    let model_to = cell_with(&cells, "model_1.to(device) # the device");
    assert_eq!(analyze(model_to).device.map(|d| d.label), Some(Device::Gpu));
    // Choosing the device is not a sign; plotting and imports are not either.
    let choose = cell_with(&cells, "device = \"cuda\" if torch.cuda.is_available()");
    let a = analyze(choose);
    assert_eq!(a.device, None);
    assert!(a.writes.contains("device"));
    let imports = cell_with(&cells, "import matplotlib.pyplot as plt");
    assert_eq!(analyze(imports).device, None);
    let plot = cell_with(&cells, "plt.plot(epoch_count, train_loss_values");
    assert_eq!(analyze(plot).device, None);
    // The training loop (on the GPU only through its variables) reads them.
    let train = cell_with(&cells, "X_train = X_train.to(device)");
    let a = analyze(train);
    for name in ["model_1", "loss_fn", "optimizer", "device"] {
        assert!(a.reads.contains(name), "training cell reads {name}: {:?}", a.reads);
    }
    // Every corpus cell analyzes without giving up.
    for cell in &cells {
        assert_eq!(analyze(cell).conservative, None, "{cell}");
    }
}

#[test]
fn every_corpus_notebook_is_precise() {
    for file in ["mrdbourke_01_pytorch_workflow.ipynb", "rasbt_ch12_part2.ipynb"] {
        for cell in corpus_cells(file) {
            let a = analyze(&cell);
            assert_eq!(a.conservative, None, "{file}: {cell}");
        }
    }
}
