// Package attach is where programs run: it attaches XDP and tc programs to
// interfaces (XDP links, tcx links, clsact qdiscs and their filters), in the
// agent's network namespace or in a pod's, and finds which interfaces carry
// the traffic to an endpoint (routes, neighbour entries, bridge forwarding
// tables, veth peers) and when that may have changed (netlink events).
//
// It is the only package that touches links, qdiscs, filters and netlink
// for attaching. The agent decides what runs where; this package knows
// how. It takes programs as *ebpf.Program handles and never looks inside
// them, and it imports nothing of rlagent's.
//
// # What it owns, and lifetimes
//
// Every attachment is pinned under <pinDir>/links (the layout is in
// pins.go), and the pins are the whole state: an Attacher holds no handle
// once a call returns. So:
//
//   - Attachments outlive the agent. A restarted agent (a new Attacher on
//     the same pin directory) finds them, and Attach swaps their program
//     atomically (LINK_UPDATE for XDP and tcx links, an in-place replace of
//     the same filter for clsact): no packet passes a hook without a
//     program while an agent restarts or upgrades.
//   - Detach and Cleanup (rlagent cleanup) remove them; Attach removes one
//     only once another of ours is in place on the same hook (a clsact
//     filter after a tcx link replaced it, or the other way round). A pin
//     whose hook went away (the interface was deleted; the kernel then
//     clears the link's interface) is dead: Alive says so and keeps it,
//     Attach replaces it, Detach and Cleanup remove it.
//   - Pins of another namespace are filed under that namespace's identity
//     (its nsfs inode), so that two pods' eth0 never share a pin, with a
//     record of the path used to reach it. When the pod goes, its
//     interfaces and every program on them go with it; its pins stay dead
//     until the agent detaches that Point (or Cleanup runs).
//   - What is not ours is never touched: another program on the XDP hook
//     makes Attach fail with ErrXDPBusy; other tcx programs keep their
//     places; a clsact qdisc is added only where none is and never removed
//     (others' filters may sit on it, and an empty one costs nothing); our
//     filters are told from others' by their name (rlagent-...).
//   - The fq qdisc that paced limits need (qdisc.go): CheckFQ only reads;
//     EnsureFQ puts fq only where the kernel's default qdisc is, never over
//     one someone configured; ours is told from others' by its handle
//     (major 0x524c, "RL", and the next ones for mq's queues). RemoveFQ,
//     and Cleanup on every interface of its namespace, delete ours: the
//     kernel puts its default back. Unlike the links, the fq is not pinned:
//     it stays on the interface while the agent restarts.
//
// Alive, Pinned and FindEndpoints only read, so that rlagent status can
// call them while an agent runs or after it stopped.
//
// # tc: tcx at the head, returning TCX_NEXT
//
// tcx (kernel 6.6+) runs a hook's programs in order and stops at the first
// that returns anything but TCX_NEXT. Ours goes at the head so that a
// packet meets the limit before a program that could end the chain
// (TCX_PASS, TCX_DROP, a redirect) decides for it, and it returns TCX_NEXT
// when it passes a packet, so that the programs after it still run, in
// their order: attaching before the first one moves none of them, and an
// update keeps ours in its place. (Cilium attaches at the tail and returns
// TC_ACT_OK, which ends the chain; ours at its head leaves Cilium's work
// untouched.)
//
// # tc on 6.1-6.5: clsact
//
// Kernels before 6.6 have no tcx: link.AttachTCX fails with
// link.ErrNotSupported, and the program becomes a direct-action bpf filter
// on the interface's clsact qdisc, added through netlink (the one fallback
// Cilium uses too). TC_ACT_UNSPEC (-1, the value of TCX_NEXT) lets the next
// filter run, so the same program works on both. The filter goes below
// every other filter's priority where it can; bpffs holds no plain files,
// so its record is its program, pinned. On a kernel with tcx, clsact
// filters run after every tcx program returned TCX_NEXT; a filter of ours
// left from the clsact path is removed once a tcx link is in place.
//
// # Pods
//
// A packet into a pod leaves the host through the egress hook of the host
// side of the pod's veth, found from the route to the pod's address
// (ViaRoute) or, where the route points at a bridge, from the node's
// neighbour entry and the bridge's FDB (ViaBridge). A CNI that hands
// packets to the pod's own interface with bpf_redirect_peer (Cilium's BPF
// host routing) skips that hook; the pod side's ingress sees them, and
// FindEndpoints gives its Point (Peer.Ingress) when it finds a file of the
// pod's namespace: in NetnsDirs (bind mounts, as ip netns and CNI plugins
// make) or as /proc/PID/ns/net (which needs the host's PID namespace). XDP
// and tcx links are created on a thread switched into that namespace (the
// kernel resolves the interface index in the calling thread's namespace)
// and switched back.
package attach
