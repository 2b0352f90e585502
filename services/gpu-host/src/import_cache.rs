//! The import cache (DESIGN.md section 7): a tree of zygotes per host. The base
//! imports the head packages and always stays; child zygotes, forked from the base,
//! add tail packages that recipes keep asking for. A worker forks from the deepest
//! zygote whose packages are all in its import closure, then imports the rest.
//! The tree is bounded by a count; the least recently used child goes first.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use crate::socket::Listener;
use crate::zygotes::{Zygote, ZygoteError, ZygoteSpec};

/// A recipe asking this many times for the same tail packages gets a child zygote.
const SPAWN_AFTER: u32 = 2;

struct ChildZygote {
    zygote: Zygote,
    /// Top-level packages it adds to the base.
    tail: BTreeSet<String>,
    /// The dotted modules it imported for them.
    modules: BTreeSet<String>,
    last_used: Instant,
}

/// Index of the child with the most tail packages that are all in `tail`.
fn deepest<'a>(children: impl Iterator<Item = &'a BTreeSet<String>>, tail: &BTreeSet<String>) -> Option<usize> {
    children.enumerate().filter(|(_, t)| t.is_subset(tail)).max_by_key(|(_, t)| t.len()).map(|(i, _)| i)
}

/// Which children to evict (indices) so that at most `max_count` remain and their
/// private memory fits `max_bytes`: least recently used first; the newest (last)
/// child always stays. `children` is (last used, private bytes).
fn evictions(children: &[(Instant, u64)], max_count: usize, max_bytes: u64) -> Vec<usize> {
    let Some(newest) = children.len().checked_sub(1) else { return vec![] };
    let mut order: Vec<usize> = (0..newest).collect();
    order.sort_by_key(|&i| children[i].0);
    let mut count = children.len();
    let mut bytes: u64 = children.iter().map(|c| c.1).sum();
    let mut out = Vec::new();
    for i in order {
        if count <= max_count && bytes <= max_bytes {
            break;
        }
        out.push(i);
        count -= 1;
        bytes -= children[i].1;
    }
    out
}

/// Memory a process does not share with others (its private pages), from
/// /proc; 0 if unreadable.
fn private_bytes(pid: u32) -> u64 {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) else { return 0 };
    text.lines()
        .filter(|l| l.starts_with("Private_Clean:") || l.starts_with("Private_Dirty:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>()
        * 1024
}

/// The zygote tree of one host.
pub struct ImportCache {
    spec: ZygoteSpec,
    base: Option<Zygote>,
    children: Vec<ChildZygote>,
    asked: HashMap<BTreeSet<String>, u32>,
    /// Dotted modules asked for, by top-level package: a child zygote imports all
    /// of them (importing `sklearn` does not import `sklearn.preprocessing`).
    modules: HashMap<String, BTreeSet<String>>,
    spawning: BTreeSet<BTreeSet<String>>,
    max_children: usize,
    /// Private memory (bytes not shared with the base) all children may use.
    max_child_bytes: u64,
    /// Forks whose whole tail was already imported by the zygote they came from.
    pub hits: u64,
    /// Forks that had to import some tail package after the fork.
    pub misses: u64,
}

/// Which zygote to fork from, and whether a child zygote should be built.
pub struct Choice {
    /// Index into children, or None for the base.
    child: Option<usize>,
    /// The chosen zygote had already imported the whole tail.
    pub covered: bool,
    /// A tail worth a child zygote of its own.
    pub spawn: Option<BTreeSet<String>>,
}

impl Choice {
    /// Whether the choice is the base zygote.
    pub fn is_base(&self) -> bool {
        self.child.is_none()
    }
}

impl ImportCache {
    /// A cache that starts its base zygote with `spec` and keeps up to
    /// `max_children` child zygotes, within `max_child_bytes` of private memory.
    pub fn new(spec: ZygoteSpec, max_children: usize, max_child_bytes: u64) -> Self {
        Self {
            spec,
            base: None,
            children: Vec::new(),
            asked: HashMap::new(),
            modules: HashMap::new(),
            spawning: BTreeSet::new(),
            max_children,
            max_child_bytes,
            hits: 0,
            misses: 0,
        }
    }

    /// Start the base zygote if it is not running.
    pub async fn ensure_base(&mut self, listener: &Listener, id: &str) -> Result<(), ZygoteError> {
        if self.base.is_none() {
            self.base = Some(Zygote::start(&self.spec, id, listener).await?);
        }
        Ok(())
    }

    /// Forget the base zygote (it failed); the next fork starts a new one.
    pub fn drop_base(&mut self) {
        self.base = None;
        self.children.clear();
    }

    /// Every live zygote: the base, then the children.
    pub fn zygotes(&self) -> impl Iterator<Item = &Zygote> {
        self.base.iter().chain(self.children.iter().map(|c| &c.zygote))
    }

    /// The tail of an import closure: top-level packages the base zygote did not
    /// import and that are not in the standard library.
    pub fn tail(&mut self, imports: &[String]) -> BTreeSet<String> {
        let tail = self.tail_of(imports);
        for module in imports {
            let top = module.split('.').next().unwrap_or_default();
            if tail.contains(top) {
                self.modules.entry(top.to_string()).or_default().insert(module.clone());
            }
        }
        tail
    }

    /// How much of an import closure's tail the deepest usable zygote has already
    /// imported (1.0: nothing left to import after fork). For a host's claim score.
    pub fn coverage(&self, imports: &[String]) -> f64 {
        let tail = self.tail_of(imports);
        if tail.is_empty() {
            return 1.0;
        }
        match deepest(self.children.iter().map(|c| &c.tail), &tail) {
            Some(i) => self.children[i].tail.len() as f64 / tail.len() as f64,
            None => 0.0,
        }
    }

    fn tail_of(&self, imports: &[String]) -> BTreeSet<String> {
        let known: BTreeSet<String> = {
            let mut k: BTreeSet<String> = self.zygotes().flat_map(|z| z.cuda_unsafe.iter().cloned()).collect();
            if let Some(b) = &self.base {
                k.extend(b.packages.iter().cloned());
                k.extend(b.stdlib.iter().cloned());
                k.extend(b.loaded.iter().cloned());
            }
            k
        };
        let mut tail = BTreeSet::new();
        for module in imports {
            let top = module.split('.').next().unwrap_or_default();
            if top.is_empty() || known.contains(top) || matches!(top, "__main__" | "builtins") {
                continue;
            }
            tail.insert(top.to_string());
        }
        tail
    }

    /// The dotted modules a child zygote for `tail` imports.
    pub fn modules_of(&self, tail: &BTreeSet<String>) -> Vec<String> {
        tail.iter().flat_map(|t| self.modules.get(t).into_iter().flatten().cloned()).collect()
    }

    /// Pick the deepest zygote whose tail packages are all in `tail`, and note the
    /// request (a tail asked for often enough deserves a child zygote).
    pub fn choose(&mut self, tail: &BTreeSet<String>) -> Choice {
        let best = deepest(self.children.iter().map(|c| &c.tail), tail);
        let wanted: BTreeSet<String> = self.modules_of(tail).into_iter().collect();
        let covered = match best {
            Some(i) => self.children[i].tail == *tail && wanted.is_subset(&self.children[i].modules),
            None => tail.is_empty(),
        };
        if covered {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        // Asked for often enough: a child for this tail, or a fresher one that also
        // has the submodules asked for since the last was built.
        let spawn = if covered || tail.is_empty() || self.spawning.contains(tail) {
            None
        } else {
            let n = self.asked.entry(tail.clone()).or_insert(0);
            *n += 1;
            (*n >= SPAWN_AFTER).then(|| {
                *n = 0;
                tail.clone()
            })
        };
        if let Some(t) = &spawn {
            self.spawning.insert(t.clone());
        }
        Choice { child: best, covered, spawn }
    }

    /// The zygote a choice names (the base if the child went away meanwhile).
    pub fn zygote(&mut self, choice: &Choice) -> Option<&mut Zygote> {
        match choice.child {
            Some(i) if i < self.children.len() => {
                let c = &mut self.children[i];
                c.last_used = Instant::now();
                Some(&mut c.zygote)
            }
            _ => self.base.as_mut(),
        }
    }

    /// The base zygote, to spawn children from.
    pub fn base(&mut self) -> Option<&mut Zygote> {
        self.base.as_mut()
    }

    /// A child zygote is ready: keep it, evicting the least recently used child if
    /// the tree is full. A child whose tail touched CUDA is not kept.
    pub fn add_child(&mut self, tail: BTreeSet<String>, modules: Vec<String>, zygote: Zygote) {
        self.spawning.remove(&tail);
        if zygote.packages.is_empty() {
            tracing::warn!(zygote = %zygote.id, unsafe_ = ?zygote.cuda_unsafe, "child zygote touched CUDA; not kept");
            if let Some(base) = &mut self.base {
                base.cuda_unsafe.extend(zygote.cuda_unsafe.iter().cloned());
            }
            return;
        }
        // a fresher child for the same tail replaces the old one
        self.children.retain(|c| c.tail != tail);
        self.children.push(ChildZygote {
            zygote,
            tail,
            modules: modules.into_iter().collect(),
            last_used: Instant::now(),
        });
        let sizes: Vec<(Instant, u64)> =
            self.children.iter().map(|c| (c.last_used, private_bytes(c.zygote.pid))).collect();
        let mut evict = evictions(&sizes, self.max_children, self.max_child_bytes);
        evict.sort_unstable_by(|a, b| b.cmp(a));
        for i in evict {
            let old = self.children.remove(i);
            tracing::info!(zygote = %old.zygote.id, tail = ?old.tail, bytes = sizes[i].1, "evicting child zygote");
        }
    }

    /// A child zygote could not be built; allow trying again later.
    pub fn child_failed(&mut self, tail: &BTreeSet<String>) {
        self.spawning.remove(tail);
        self.asked.remove(tail);
    }

    /// A fork from a child failed: drop that child.
    pub fn drop_child(&mut self, choice: &Choice) {
        if let Some(i) = choice.child {
            if i < self.children.len() {
                self.children.remove(i);
            }
        }
    }

    /// Stop every zygote.
    pub async fn shutdown(&mut self) {
        self.children.clear();
        if let Some(z) = self.base.take() {
            z.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(xs: &[&str]) -> BTreeSet<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn forks_from_the_deepest_zygote_whose_packages_are_all_wanted() {
        let children = [set(&["sklearn"]), set(&["sklearn", "matplotlib"]), set(&["scipy", "seaborn"])];
        assert_eq!(deepest(children.iter(), &set(&["sklearn", "matplotlib", "jax"])), Some(1));
        assert_eq!(deepest(children.iter(), &set(&["sklearn"])), Some(0));
        assert_eq!(deepest(children.iter(), &set(&["scipy"])), None, "seaborn is not wanted");
        assert_eq!(deepest(children.iter(), &set(&[])), None);
    }

    #[test]
    fn the_tree_is_bounded_by_count_and_memory_least_recently_used_first() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + std::time::Duration::from_secs(s);
        // (last used, private bytes); the last is the child just added
        let kids = [(at(5), 100), (at(1), 300), (at(3), 200), (at(9), 50)];
        assert!(evictions(&kids, 4, 1000).is_empty());
        assert_eq!(evictions(&kids, 3, 1000), vec![1], "over the count: the least recently used goes");
        assert_eq!(evictions(&kids, 4, 400), vec![1], "over memory: LRU until it fits (650 - 300)");
        assert_eq!(evictions(&kids, 4, 300), vec![1, 2]);
        assert_eq!(evictions(&kids, 4, 10), vec![1, 2, 0], "the newest child always stays");
        assert!(evictions(&[], 0, 0).is_empty());
        assert!(private_bytes(std::process::id()) > 0, "reads this process's private memory");
    }

    #[test]
    fn a_tail_asked_for_twice_gets_one_child_zygote() {
        let spec = ZygoteSpec {
            python: "python3".into(),
            worker_path: Some(".".into()),
            packages: vec![],
            env: Default::default(),
            spare_cgroups: None,
        };
        let mut cache = ImportCache::new(spec, 2, 1 << 30);
        let tail = set(&["sklearn"]);
        assert!(cache.choose(&tail).spawn.is_none());
        assert_eq!(cache.choose(&tail).spawn, Some(tail.clone()));
        assert!(cache.choose(&tail).spawn.is_none(), "already being built");
        assert_eq!((cache.hits, cache.misses), (0, 3));
        cache.child_failed(&tail);
        assert!(cache.choose(&tail).spawn.is_none(), "counting starts again");
        assert_eq!(cache.choose(&tail).spawn, Some(tail.clone()));
        assert!(cache.choose(&set(&[])).spawn.is_none());
        assert_eq!(cache.hits, 1, "an empty tail is a hit on the base");
    }
}
