//! Which container (and, under Kubernetes, which pod) a client runs in, from its cgroup path as
//! the kernel shows it in `/proc/<peer pid>/cgroup`: the client cannot choose it, unlike the
//! names it sends (`POD_NAME`, ...). Runtimes name a container's cgroup after its id and the
//! kubelet a pod's after its uid:
//!
//! | layout | a container's cgroup |
//! |---|---|
//! | Kubernetes, cgroupfs driver (v1 and v2) | `/kubepods/burstable/pod<uid>/<id>` (also `crio-<id>`, `besteffort`, or no QoS level for guaranteed pods) |
//! | Kubernetes, systemd driver | `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope` (`crio-`, `docker-`) |
//! | podman | `/libpod_parent/libpod-<id>` (cgroupfs), `/machine.slice/libpod-<id>.scope[/container]` (systemd) |
//! | Docker | `/docker/<id>`, `/system.slice/docker-<id>.scope` |
//!
//! An id is 64 hex digits; a pod uid is a UUID. The runtime's monitor (`libpod-conmon-<id>`,
//! `crio-conmon-<id>`) is not the container. A sidecar in a cgroup namespace of its own sees
//! paths relative to it (`/../../kubepods/...`): the components are the same.

/// What the cgroup path says.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Identity {
    pub container_id: Option<String>,
    pub pod_uid: Option<String>,
}

fn hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A container id named by one path component.
fn container_of(component: &str) -> Option<String> {
    let c = component.strip_suffix(".scope").unwrap_or(component);
    if hex64(c) {
        return Some(c.to_ascii_lowercase());
    }
    let (prefix, id) = c.rsplit_once('-')?;
    (hex64(id) && !prefix.is_empty() && !prefix.split('-').any(|p| p == "conmon")).then(|| id.to_ascii_lowercase())
}

fn uuid(s: &str) -> Option<String> {
    let parts: Vec<&str> = s.split('-').collect();
    let ok = parts.len() == 5
        && parts.iter().zip([8, 4, 4, 4, 12]).all(|(p, n)| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit()));
    ok.then(|| s.to_ascii_lowercase())
}

/// A pod uid named by one component below `kubepods`: `pod<uid>` (cgroupfs) or
/// `kubepods[-<qos>]-pod<uid with _ for ->.slice` (systemd).
fn pod_of(component: &str) -> Option<String> {
    if let Some(u) = component.strip_prefix("pod") {
        return uuid(u);
    }
    let c = component.strip_suffix(".slice")?;
    let (_, u) = c.rsplit_once("-pod")?;
    c.starts_with("kubepods").then(|| uuid(&u.replace('_', "-"))).flatten()
}

fn from_path(path: &str) -> Identity {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty() && *p != "..").collect();
    let container_id = parts.iter().rev().find_map(|p| container_of(p));
    let kube = parts.iter().position(|p| p.starts_with("kubepods"));
    let pod_uid = kube.and_then(|k| parts[k + 1..].iter().find_map(|p| pod_of(p)));
    Identity { container_id, pod_uid }
}

/// The identity in `/proc/<pid>/cgroup`'s text: from the unified (v2) line if it names a
/// container, else from the first v1 line that does (`name=systemd` first, as the systemd
/// driver names it there).
pub fn from_cgroup(text: &str) -> Identity {
    let mut lines: Vec<(u8, &str)> = text
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
            let rank = if id == "0" && controllers.is_empty() {
                0
            } else if controllers.contains("name=systemd") {
                1
            } else {
                2
            };
            Some((rank, path))
        })
        .collect();
    lines.sort_by_key(|(r, _)| *r);
    lines.iter().map(|(_, p)| from_path(p)).find(|i| i.container_id.is_some()).unwrap_or_default()
}

/// The identity of a connected client, by its peer pid (0: not in our PID namespace).
pub fn of_pid(pid: i32) -> Identity {
    if pid <= 0 {
        return Identity::default();
    }
    use std::io::Read;
    let mut text = String::new();
    let read = std::fs::File::open(format!("/proc/{pid}/cgroup")).and_then(|f| f.take(64 << 10).read_to_string(&mut text));
    if read.is_err() { Identity::default() } else { from_cgroup(&text) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "1d45a55e836b5108fa4cc2a0bd6c3967905d9f39b75d5afc96a02c6bb3ae4f37";
    const UID: &str = "6f3b3e8a-8d5c-4a4f-9a0b-2e4f5c6d7e8f";

    fn both(text: &str) -> (Option<String>, Option<String>) {
        let i = from_cgroup(text);
        (i.container_id, i.pod_uid)
    }

    fn want(pod: bool) -> (Option<String>, Option<String>) {
        (Some(ID.to_string()), pod.then(|| UID.to_string()))
    }

    #[test]
    fn kubernetes_cgroupfs_driver_v1_and_v2() {
        let v1 = format!(
            "12:pids:/kubepods/burstable/pod{UID}/{ID}\n11:memory:/kubepods/burstable/pod{UID}/{ID}\n1:name=systemd:/kubepods/burstable/pod{UID}/{ID}\n"
        );
        assert_eq!(both(&v1), want(true));
        assert_eq!(both(&format!("0::/kubepods/besteffort/pod{UID}/crio-{ID}\n")), want(true));
        // Guaranteed pods have no QoS level; a sidecar in its own cgroup namespace sees `..`.
        assert_eq!(both(&format!("0::/../../kubepods/pod{UID}/{ID}\n")), want(true));
    }

    #[test]
    fn kubernetes_systemd_driver_v1_and_v2() {
        let u = UID.replace('-', "_");
        let v2 = format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{ID}.scope\n");
        assert_eq!(both(&v2), want(true));
        let v1 = format!(
            "4:memory:/kubepods.slice/kubepods-pod{u}.slice/crio-{ID}.scope\n1:name=systemd:/kubepods.slice/kubepods-pod{u}.slice/crio-{ID}.scope\n0::/\n"
        );
        assert_eq!(both(&v1), want(true));
        let docker = format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/docker-{ID}.scope\n");
        assert_eq!(both(&docker), want(true));
    }

    #[test]
    fn podman_and_docker_containers_have_no_pod_uid() {
        for text in [
            format!("9:name=systemd:/libpod_parent/libpod-{ID}\n4:memory:/libpod_parent/libpod-{ID}\n0::/libpod_parent/libpod-{ID}\n"),
            format!("0::/machine.slice/libpod-{ID}.scope/container\n"),
            format!("0::/machine.slice/machine-libpod_pod_{}.slice/libpod-{ID}.scope\n", &ID[..64]),
            format!("0::/system.slice/docker-{ID}.scope\n"),
            format!("12:pids:/docker/{ID}\n"),
        ] {
            assert_eq!(both(&text), want(false), "{text}");
        }
    }

    #[test]
    fn hosts_monitors_and_lookalikes_are_no_container() {
        for text in [
            "0::/user.slice/user-1000.slice/session-3.scope\n".to_string(),
            "4:memory:/process_api/cb88bd75c0da0534c7c0965fee3f9bd3\n0::/\n".into(),
            format!("0::/machine.slice/libpod-conmon-{ID}.scope\n"),
            format!("0::/kubepods/burstable/pod{UID}/crio-conmon-{ID}\n"),
            format!("0::/x/{}\n", &ID[..63]),
            "garbage without colons\n".into(),
            String::new(),
        ] {
            assert_eq!(both(&text), (None, None), "{text}");
        }
        // A pod directory outside kubepods is not a Kubernetes pod.
        assert_eq!(both(&format!("0::/pod{UID}/{ID}\n")), want(false));
    }

    #[test]
    fn this_process_has_an_identity_or_none_without_panicking() {
        let _ = of_pid(std::process::id() as i32);
        assert_eq!(of_pid(0), Identity::default());
    }
}
