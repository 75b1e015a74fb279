//! What one launch of a CUDA graph allocates: every memory allocation node reachable from the
//! graph, however deeply nested in child graph nodes. A graph holding memory nodes can be a child
//! only when moved into its parent (`CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE`, CUDA 12.9,
//! `cuGraphAddNode_v2`), and `cuGraphGetNodes` lists a graph's own nodes only, so the walk goes
//! down through `cuGraphChildGraphNodeGetGraph`. Moved children form a tree, so the walk reads
//! every node however many there are: stopping early would leave the nodes past that point
//! uncharged (the launch would allocate them past the cap before any settle could see them). A
//! graph reached twice (never, by the documentation) is read once, so the walk always ends.

use crate::ffi::*;
use crate::hooks::import;
use crate::ledger::MAX_DEVICES;
use std::collections::HashSet;

const GRANULARITY: u64 = 2 << 20;

/// Bytes per device.
pub type Needs = Vec<(u16, u64)>;

#[derive(Default)]
pub struct Walk {
    /// What one launch may allocate, per device: the sum of its allocation nodes.
    pub need: Needs,
    /// Of that, what no free node of the graph releases (what a launch leaves allocated).
    pub held: Needs,
    /// Every node was read.
    pub complete: bool,
}

fn add(v: &mut Needs, dev: u16, bytes: u64) {
    match v.iter_mut().find(|(d, _)| *d == dev) {
        Some((_, b)) => *b = b.saturating_add(bytes),
        None => v.push((dev, bytes)),
    }
}

fn nodes_of(graph: CUgraph) -> Option<Vec<CUgraphNode>> {
    let f = import::cuGraphGetNodes()?;
    let mut n = 0usize;
    if unsafe { f(graph, std::ptr::null_mut(), &mut n) } != CUDA_SUCCESS {
        return None;
    }
    if n == 0 {
        return Some(Vec::new());
    }
    let mut all: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    if unsafe { f(graph, all.as_mut_ptr(), &mut n) } != CUDA_SUCCESS {
        return None;
    }
    all.truncate(n);
    Some(all)
}

pub fn walk(graph: CUgraph) -> Walk {
    let (Some(kind), Some(params)) = (import::cuGraphNodeGetType(), import::cuGraphMemAllocNodeGetParams()) else {
        return Walk { complete: true, ..Walk::default() }; // a driver without graph memory nodes
    };
    let mut out = Walk { complete: true, ..Walk::default() };
    let mut allocs: Vec<(u16, u64, CUdeviceptr)> = Vec::new();
    let mut freed: HashSet<CUdeviceptr> = HashSet::new();
    let mut stack = vec![graph];
    let mut read: HashSet<usize> = HashSet::new();
    while let Some(g) = stack.pop() {
        if !read.insert(g as usize) {
            continue;
        }
        let Some(nodes) = nodes_of(g) else {
            out.complete = false;
            continue;
        };
        for node in nodes {
            let mut t = -1;
            if unsafe { kind(node, &mut t) } != CUDA_SUCCESS {
                out.complete = false;
                continue;
            }
            match t {
                CU_GRAPH_NODE_TYPE_MEM_ALLOC => {
                    let mut p: CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
                    if unsafe { params(node, &mut p) } != CUDA_SUCCESS {
                        out.complete = false;
                        continue;
                    }
                    // Placed as every other location is (a device's locality domain is that
                    // device's memory); one vramcap cannot place makes the walk incomplete, so
                    // every device is re-read after each launch rather than trusted.
                    let dev = match super::location::place(p.pool_props.location) {
                        super::location::Place::Device(d) if d < MAX_DEVICES => d,
                        super::location::Place::Host => continue,
                        _ => {
                            out.complete = false;
                            continue;
                        }
                    };
                    let bytes = (p.bytesize as u64).div_ceil(GRANULARITY).saturating_mul(GRANULARITY);
                    allocs.push((dev as u16, bytes, p.dptr));
                }
                CU_GRAPH_NODE_TYPE_MEM_FREE => {
                    // Unreadable: counted as freeing nothing we know, so nothing is taken for held.
                    let mut dptr: CUdeviceptr = 0;
                    match import::cuGraphMemFreeNodeGetParams() {
                        Some(f) if unsafe { f(node, &mut dptr) } == CUDA_SUCCESS => {
                            freed.insert(dptr);
                        }
                        _ => {
                            freed.insert(CUdeviceptr::MAX);
                        }
                    }
                }
                CU_GRAPH_NODE_TYPE_GRAPH => {
                    let mut child: CUgraph = std::ptr::null_mut();
                    match import::cuGraphChildGraphNodeGetGraph() {
                        Some(f) if unsafe { f(node, &mut child) } == CUDA_SUCCESS && !child.is_null() => stack.push(child),
                        _ => out.complete = false,
                    }
                }
                _ => {}
            }
        }
    }
    // An unreadable free node might release any allocation: then nothing counts as held.
    let unsure = freed.contains(&CUdeviceptr::MAX);
    for (dev, bytes, dptr) in allocs {
        add(&mut out.need, dev, bytes);
        if !unsure && !freed.contains(&dptr) {
            add(&mut out.held, dev, bytes);
        }
    }
    out
}
