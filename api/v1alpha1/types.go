package v1alpha1

import (
	"encoding/json"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Config is the agent's config file (rlagent run --config FILE).
type Config struct {
	// Interfaces are the node's uplinks, where the XDP program attaches:
	// auto, or a list of Linux interface names.
	// auto: the interfaces that carry the node's default routes (IPv4 and
	// IPv6, the main table) and its own addresses (the pod's status.hostIPs,
	// $HOST_IPS), followed as routes and links change. An interface
	// without native XDP (a bond of drivers without it, a VLAN, a bridge)
	// gets generic XDP, or TC ingress with xdpFallback tc.
	// (Required) auto, or at least one name, each 1..15 characters and
	// listed once.
	Interfaces InterfaceList `json:"interfaces"`

	// PinDir is the directory on a BPF filesystem where maps and links are
	// pinned, so that enforcement survives a restart of the agent.
	// (Optional) An absolute path; default /sys/fs/bpf/rlagent.
	PinDir string `json:"pinDir,omitempty"`

	// MetricsAddress is the host:port that serves Prometheus metrics, or
	// "off" to serve none.
	// (Optional) Default "127.0.0.1:9478". Never empty after defaulting.
	MetricsAddress string `json:"metricsAddress,omitempty"`

	// SecureMetrics serves /metrics over TLS to the clients the cluster's
	// API server vouches for, so that Prometheus can scrape the agent from
	// off the node; the plain metricsAddress listener (and the probes on
	// it) stays as it is. See SecureMetrics.
	// (Optional) Default: off.
	SecureMetrics SecureMetrics `json:"secureMetrics,omitzero"`

	// MaxBuckets is how many keyed buckets (one per key of a limit keyed by
	// src-ip, dst-ip, src-prefix or dst-port) the node holds at once; beyond
	// it the least recently used key is evicted.
	// (Optional) 1024..16777216; default 65536.
	MaxBuckets uint32 `json:"maxBuckets,omitempty"`

	// Count is where the replica count comes from when rlagent runs without
	// Kubernetes: how many replicas (each with an agent enforcing this
	// config) share each limit's global rate.
	// (Optional) Default static: 1.
	Count CountSource `json:"count,omitzero"`

	// Limits are the rate limits to enforce.
	// (Optional) May be empty; names are unique.
	Limits []Limit `json:"limits,omitempty"`

	// Protect is traffic that no limit touches: the node's lifeline, such as
	// SSH and the kubelet. Protected packets pass before any limit is looked
	// at. See Protect.
	// (Optional) At most 31 rules (the data path holds 32 and keeps one for
	// the agent's API server connection); names are unique. Left out (or
	// null): DefaultProtect, the rule ssh (tcp, localPorts [22]). An empty
	// list ([]) protects nothing, with a warning at every start and reload.
	// omitzero, not omitempty: an empty list is written back as [], a nil
	// one (left out) not at all.
	Protect []Protect `json:"protect,omitzero"`

	// ProtectAPIServer protects the agent's own connection to its API
	// server (in a cluster): the addresses and ports its packets really
	// carry, the endpoints of the Service default/kubernetes when the agent
	// runs in a pod, else the host and port of its kubeconfig. Without it a
	// limit can cut the agent off the API server that would carry the fix.
	// (Optional) Default true. false turns the protection off, with a
	// warning at every start and reload.
	ProtectAPIServer *bool `json:"protectAPIServer,omitempty"`

	// XDPFallback is what the agent does when another program already holds
	// the XDP hook of an interface: XDP is exclusive, and rlagent never
	// replaces another program's XDP. none fails: the agent does not start
	// (a reload that adds such an interface is rejected), with an error that
	// names the program holding the hook; tc enforces the uplink's ingress
	// limits from the interface's TC ingress hook instead (tcx, or clsact
	// before kernel 6.6), after the other XDP program.
	// (Optional) none | tc; default none.
	XDPFallback XDPFallback `json:"xdpFallback,omitempty"`

	// EndpointHook is where the limits with attach endpoints and direction
	// ingress (traffic into an endpoint) run. host: the TC egress hook of the
	// endpoint's host-side interface, which needs no privilege beyond the
	// agent's, but which a CNI that delivers into the pod with
	// bpf_redirect_peer (Cilium with BPF host routing) skips. pod: the TC
	// ingress hook of the endpoint's own interface inside its network
	// namespace, which every delivery passes; the agent must enter the
	// pod's network namespace (CAP_SYS_ADMIN) and find it (hostPID, or
	// /run/netns). Egress limits at endpoints always run at the host-side
	// interface's TC ingress hook, which every packet a pod sends passes.
	// (Optional) host | pod; default host.
	EndpointHook EndpointHook `json:"endpointHook,omitempty"`

	// EndpointSourceCheck is what the limits with attach endpoints and
	// direction egress do with a packet whose source is not one of its
	// endpoint's addresses (a pod that writes raw packets can put any
	// source in them). Such a packet is always charged to the limits as
	// the endpoint's, not as the address it names, and counted
	// (rlagent_datapath_endpoint_src_mismatch_total). count lets it pass:
	// NAT, VPN and egress-gateway pods send from other addresses by
	// design. drop drops it (IPv6 link-local and unspecified sources,
	// which neighbour discovery needs, pass).
	// (Optional) count | drop; default count.
	EndpointSourceCheck SourceCheck `json:"endpointSourceCheck,omitempty"`

	// DemandShares tunes the limits with share demand, in a cluster.
	// (Optional) See DemandShares.
	DemandShares DemandShares `json:"demandShares,omitzero"`

	// RejectBudget bounds the replies the node sends to packets that
	// limits with action reject drop, over all those limits: beyond it a
	// reject is a drop (counted), so that spoofed traffic can never make
	// the node a reflector.
	// (Optional) See RejectBudget.
	RejectBudget RejectBudget `json:"rejectBudget,omitzero"`

	// ManageQdisc lets the agent put the fq qdisc on the uplinks that a
	// paced limit leaves through: a departure time does nothing without fq
	// (Debian's default is fq_codel, a veth's noqueue). true: where an
	// uplink's root qdisc is a kernel default (noqueue, pfifo_fast,
	// fq_codel, mq with such children), the agent replaces it with fq (each
	// of mq's children), with a horizon above the limits' and a flow limit
	// that holds a horizon of the share, and deletes it again (the kernel's
	// default comes back) on cleanup and when no paced limit is left; a
	// qdisc an operator configured (htb, tbf, ...) is left alone. false:
	// the agent only checks, and reports PaceIneffective where fq is
	// missing.
	// (Optional) Default false.
	ManageQdisc bool `json:"manageQdisc,omitempty"`
}

// SecureMetrics is the agent's second metrics listener: TLS, and every
// request authenticated (a bearer token, checked with a TokenReview) and
// authorized (get on the non-resource URL /metrics, checked with a
// SubjectAccessReview) by the API server, as the Kubernetes components
// serve theirs. It needs a cluster: the agent runs in a pod or with
// --kubeconfig.
type SecureMetrics struct {
	// Address is the host:port to serve /metrics on, e.g. ":9479" (every
	// address of the node: the agent runs with hostNetwork).
	// (Optional) host:port with a port in 1..65535, not metricsAddress's;
	// default "": off.
	Address string `json:"address,omitempty"`

	// CertDir is a directory that holds the serving certificate, tls.crt,
	// and its key, tls.key (a mounted cert-manager Secret): they are read
	// at start and again whenever they change. Left out, the agent makes a
	// self-signed certificate at start, which Prometheus can only accept
	// without verifying it (insecureSkipVerify).
	// (Optional) An absolute path, only with address; default "".
	CertDir string `json:"certDir,omitempty"`
}

// RejectBudget is the node's budget of replies to rejected packets.
type RejectBudget struct {
	// Rate is the replies per second, sent by every CPU together; 0 sends
	// none.
	// (Optional) 0..100000; default 1000 (the kernel's own ICMP limit,
	// net.ipv4.icmp_msgs_per_sec).
	// +optional
	Rate *uint32 `json:"rate,omitempty"`

	// Burst is the replies that may go at once. The budget runs on the
	// kernel's tick (jiffies): a tick's worth of the rate (rate / HZ) is
	// allowed at once if that is more.
	// (Optional) 1..rate; default 50 (net.ipv4.icmp_msgs_burst), or the
	// rate if that is less.
	// +optional
	Burst *uint32 `json:"burst,omitempty"`

	// PerDestination is each destination's share of the replies (the
	// rejected packet's source: an IPv4 address, an IPv6 /64), checked
	// before the node's budget, so that a flood spoofing one victim's
	// address draws no more than this to the victim. A destination not
	// answered lately gets one reply at once, then the rate up to the
	// burst: a flood of other sources that pushes the victim out of the
	// table buys it nothing.
	// (Optional) See ReplyRate; default rate 100, burst 10.
	PerDestination ReplyRate `json:"perDestination,omitzero"`
}

// ReplyRate is a rate of replies.
type ReplyRate struct {
	// Rate is the replies per second.
	// (Optional) 1..100000; default 100.
	// +optional
	Rate *uint32 `json:"rate,omitempty"`

	// Burst is the replies that may go at once.
	// (Optional) 1..rate; default 10, or the rate if that is less.
	// +optional
	Burst *uint32 `json:"burst,omitempty"`
}

// DemandShares are the parameters of share demand. Every agent of a
// cluster must have the same (one ConfigMap): the elected agent's allocate,
// and each node's report and fall back.
type DemandShares struct {
	// Interval is the report interval: a node writes its demand at most
	// once an interval (only when it moved by 10%, or every 10 intervals),
	// the elected agent publishes an allocation at most twice an
	// interval, and a report is counted half an interval after it was
	// written (the time it may take to reach the elected agent). A change of demand is
	// served within about 2 to 3 intervals.
	// (Optional) 1s..10m; default 15s.
	// +optional
	Interval *metav1.Duration `json:"interval,omitempty"`

	// StaleAfter is the allocation's age at which every node is back on
	// its equal share: the decreases half an interval before it, the
	// increases at it. The elected agent republishes an
	// unchanged allocation every third of it.
	// (Optional) 3 x interval..1h; default 4 x interval.
	// +optional
	StaleAfter *metav1.Duration `json:"staleAfter,omitempty"`

	// FloorPerMille is the floor, in thousandths of the equal share
	// (rate / the nodes reporting): what every node gets, asked for or
	// not, so that a node whose traffic starts is served at once, up to
	// it, before the next allocation. The nodes' floors come out of the
	// rate; a node that joins takes its floor before the allocation counts
	// it, the only time the shares may sum above the rate.
	// (Optional) 0..20 (2%); default 10 (1%).
	// +optional
	FloorPerMille *uint32 `json:"floorPerMille,omitempty"`
}

// EndpointHook is where traffic into an endpoint is enforced.
type EndpointHook string

const (
	EndpointHookHost EndpointHook = "host"
	EndpointHookPod  EndpointHook = "pod"
)

// SourceCheck is what an endpoint's egress does with a packet from an
// address that is not the endpoint's.
type SourceCheck string

const (
	SourceCheckCount SourceCheck = "count"
	SourceCheckDrop  SourceCheck = "drop"
)

// XDPFallback is what to do when another program holds the XDP hook.
type XDPFallback string

const (
	XDPFallbackNone XDPFallback = "none"
	XDPFallbackTC   XDPFallback = "tc"
)

// CountSource says where the replica count comes from. Exactly one field is
// set. A count of 0 is accepted and treated as 1 by the agent (a count below 1
// always is, so that a limit never divides by zero).
type CountSource struct {
	// Static is a fixed count.
	// (Optional) 0 or more; default 1 when File is empty.
	Static *int32 `json:"static,omitempty"`

	// File is the absolute path of a file that holds one integer, the count.
	// The agent watches it; a missing, empty or malformed file keeps the last
	// count.
	// (Optional) No default.
	File string `json:"file,omitempty"`
}

// Limit is a named RateLimitSpec, as listed in the config file. (In the
// custom resource the name is the object's name.)
type Limit struct {
	// Name identifies the limit in the CLI, status and metrics.
	// (Required) 1..63 lowercase letters, digits and '-', starting and ending
	// with a letter or digit; unique in the file.
	Name string `json:"name"`

	// The spec's fields sit next to the name in the file.
	RateLimitSpec `json:",inline"`
}

// RateLimitSpec is one global rate limit: the rate over all replicas, which
// packets it applies to, how it splits them into buckets, and what happens to
// a packet when its bucket is empty.
//
// +kubebuilder:object:generate=true
// +kubebuilder:validation:XValidation:rule="self.scope != 'service' || has(self.match.service)",message="scope service requires match.service: the namespace/name of a Service",fieldPath=".match.service",reason=FieldValueRequired
// +kubebuilder:validation:XValidation:rule="!has(self.match.service) || self.scope == 'service'",message="match.service is only allowed with scope service",fieldPath=".match.service"
// +kubebuilder:validation:XValidation:rule="self.scope != 'pods' || has(self.match.podSelector) || has(self.match.namespaceSelector)",message="scope pods requires match.podSelector or match.namespaceSelector (or both): the pods whose ready count divides the rate",fieldPath=".match.podSelector",reason=FieldValueRequired
// +kubebuilder:validation:XValidation:rule="(!has(self.match.podSelector) && !has(self.match.namespaceSelector)) || self.scope == 'pods'",message="match.podSelector and match.namespaceSelector are only allowed with scope pods",fieldPath=".match.podSelector"
// +kubebuilder:validation:XValidation:rule="!has(self.action) || self.action != 'pace' || (has(self.match.direction) && self.match.direction == 'egress')",message="action pace needs match.direction egress: pacing delays egress packets; ingress packets cannot be delayed",fieldPath=".action"
// +kubebuilder:validation:XValidation:rule="!has(self.action) || self.action != 'pace' || (has(self.attach) ? self.attach == 'uplink' : (self.scope != 'service' && self.scope != 'pods'))",message="action pace needs attach uplink: the departure time is kept by the uplink's fq qdisc",fieldPath=".attach"
// +kubebuilder:validation:XValidation:rule="!has(self.horizon) || (has(self.action) && self.action == 'pace')",message="horizon is only allowed with action pace",fieldPath=".horizon"
// +kubebuilder:validation:XValidation:rule="!has(self.action) || self.action != 'reject' || !has(self.match.direction) || self.match.direction == 'ingress'",message="action reject needs match.direction ingress: it answers arriving packets",fieldPath=".action"
// +kubebuilder:validation:XValidation:rule="!has(self.prefixLength) || (has(self.key) && (self.key == 'src-prefix' || self.key == 'dst-prefix'))",message="prefixLength is only allowed with key src-prefix or dst-prefix",fieldPath=".prefixLength"
// +kubebuilder:validation:XValidation:rule="!has(self.attach) || self.attach != 'endpoints' || has(self.match.service) || self.scope == 'pods' || ((has(self.match.direction) && self.match.direction == 'egress') ? (has(self.match.srcCIDRs) && size(self.match.srcCIDRs) > 0) : (has(self.match.dstCIDRs) && size(self.match.dstCIDRs) > 0))",message="attach endpoints without match.service or scope pods takes the endpoint addresses from match.dstCIDRs (ingress) or match.srcCIDRs (egress): list them",fieldPath=".attach"
// +kubebuilder:validation:XValidation:rule="!has(self.unit) || self.unit != 'connections' || !has(self.match.protocol) || self.match.protocol == 'tcp' || self.match.protocol == 'any'",message="unit connections counts TCP SYNs: it needs protocol tcp or any",fieldPath=".unit"
// +kubebuilder:validation:XValidation:rule="!has(self.key) || self.key != 'dst-port' || !has(self.match.protocol) || self.match.protocol != 'icmp'",message="key dst-port needs protocol tcp, udp or any: icmp has no ports",fieldPath=".key"
// +kubebuilder:validation:XValidation:rule="!has(self.share) || self.share != 'demand' || self.scope in ['nodes', 'service', 'pods']",message="share demand needs scope nodes, service or pods: the nodes report their demands and read the allocation through the cluster",fieldPath=".share"
// +kubebuilder:validation:XValidation:rule="!has(self.share) || self.share != 'demand' || !has(self.action) || self.action != 'pace' || !has(self.key) || self.key == 'none'",message="share demand with a key cannot pace: a paced limit's departure times are kept per limit, not per key share",fieldPath=".share"
// +kubebuilder:validation:XValidation:rule="!has(self.hotKeys) || (has(self.share) && self.share == 'demand' && has(self.key) && self.key != 'none')",message="hotKeys is only allowed with share demand and a key",fieldPath=".hotKeys"
// +kubebuilder:validation:XValidation:rule="!has(self.onEmpty) || (has(self.unit) && self.unit == 'requests')",message="onEmpty is only allowed with unit requests: the kernel cannot make a packet wait on the way in (see action pace for egress)",fieldPath=".onEmpty"
// +kubebuilder:validation:XValidation:rule="!has(self.maxWait) || (has(self.onEmpty) && self.onEmpty == 'wait')",message="maxWait is only allowed with onEmpty wait",fieldPath=".maxWait"
// +kubebuilder:validation:XValidation:rule="!has(self.key) || self.key != 'custom' || (has(self.unit) && self.unit == 'requests')",message="key custom is only allowed with unit requests: it is the application's key function",fieldPath=".key"
// +kubebuilder:validation:XValidation:rule="!has(self.unit) || self.unit != 'requests' || (self.scope != 'nodes' && self.scope != 'pods')",message="unit requests is enforced in the Service's own processes: scope service (divided by its ready endpoints) or static, not nodes or pods",fieldPath=".scope"
// +kubebuilder:validation:XValidation:rule="!has(self.unit) || self.unit != 'requests' || !has(self.key) || self.key in ['none', 'src-ip', 'src-prefix', 'custom']",message="unit requests allows key none, src-ip, src-prefix (the client's address) or custom",fieldPath=".key"
// +kubebuilder:validation:XValidation:rule="!has(self.unit) || self.unit != 'requests' || !has(self.action) || self.action in ['drop', 'shadow']",message="unit requests allows action drop or shadow (onEmpty says whether a request fails or waits)",fieldPath=".action"
// +kubebuilder:validation:XValidation:rule="!has(self.unit) || self.unit != 'requests' || !has(self.share) || self.share == 'equal'",message="unit requests allows share equal only",fieldPath=".share"
// +kubebuilder:validation:XValidation:rule="!has(self.unit) || self.unit != 'requests' || !has(self.attach)",message="attach is not allowed with unit requests: no node installs the limit",fieldPath=".attach"
// +kubebuilder:validation:XValidation:rule="!has(self.unit) || self.unit != 'requests' || ((!has(self.match.direction) || self.match.direction == 'ingress') && (!has(self.match.protocol) || self.match.protocol == 'any') && (!has(self.match.dstPorts) || size(self.match.dstPorts) == 0) && (!has(self.match.srcCIDRs) || size(self.match.srcCIDRs) == 0) && (!has(self.match.dstCIDRs) || size(self.match.dstCIDRs) == 0))",message="unit requests matches every request of the processes that enforce it: match may only name the Service (direction ingress, protocol any, no ports, no CIDRs)",fieldPath=".match"
// +kubebuilder:validation:XValidation:rule="!has(self.burst) || self.rate > 4000000000 || self.burst <= self.rate * 3600",message="burst must be at most 3600 seconds of rate (rate x 3600)",fieldPath=".burst"
type RateLimitSpec struct {
	// Rate is the global rate, in units per second over all replicas; each
	// node enforces its share.
	// (Required) 1..4000000000: at most what one node's data path enforces
	// (MaxNodeRate, 32 Gbit/s in bytes), since the replica count can fall to
	// 1. A node share above it (from a spec that skipped validation) is
	// clamped to it and reported as clamped.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=4000000000
	Rate uint64 `json:"rate"`

	// Unit is what one token is worth: a packet (a TCP segment of a GSO or
	// GRO packet counts one each), a byte on the wire, or a connection
	// attempt (a TCP SYN without ACK, RST or FIN; the limit's other TCP
	// packets are not charged; a packet whose transport header cannot be
	// found counts as one attempt), or a request: a limit with unit
	// requests is not enforced by the node agents but inside the Service's
	// own processes, by the rlagent limiter library (package limiter), per
	// HTTP request or gRPC call. See docs/library.md.
	// (Optional) packets | bytes | connections | requests; default packets.
	// connections needs protocol tcp or any (then only TCP SYNs count).
	// requests needs scope service (divided by the Service's ready
	// endpoints: its processes) or static, an empty match (but for
	// match.service), key none, src-ip, src-prefix or custom, action drop
	// or shadow, share equal, and no attach.
	// +kubebuilder:default=packets
	// +optional
	Unit Unit `json:"unit,omitempty"`

	// Burst is the global bucket size in units, divided over replicas like
	// the rate.
	// (Optional) At least 1 and at most 3600 seconds of Rate; default
	// Rate/10, at least 1. Left out, it follows Rate when Rate changes
	// (EffectiveBurst computes it).
	// +kubebuilder:validation:Minimum=1
	// +optional
	Burst *uint64 `json:"burst,omitempty"`

	// Match selects the packets the limit applies to.
	// (Required) The key must be present; every field in it is optional and
	// an empty match applies to every ingress packet.
	// +required
	Match Match `json:"match"`

	// Key is how the limit splits traffic into buckets: one bucket for the
	// whole limit, or one per source address, destination address, source
	// prefix, destination prefix or destination port. Each bucket gets the
	// whole rate.
	// With unit requests, src-ip and src-prefix are the request's client
	// address, and custom is whatever the application's key function
	// returns for the request (a header, an API key).
	// (Optional) none | src-ip | dst-ip | src-prefix | dst-prefix | dst-port
	// | custom; default none. custom only with unit requests, which allows
	// none, src-ip, src-prefix and custom.
	// +kubebuilder:default=none
	// +optional
	Key Key `json:"key,omitempty"`

	// PrefixLength is the prefix that groups source (key src-prefix) or
	// destination (key dst-prefix) addresses into one bucket.
	// (Optional) Only with key src-prefix or dst-prefix; default ipv4 24,
	// ipv6 64.
	// +optional
	PrefixLength *PrefixLength `json:"prefixLength,omitempty"`

	// Scope is how the global rate is divided among replicas.
	// (Optional in the file, default static; Required in Kubernetes.)
	// static | nodes | service | pods. In the file (no Kubernetes) only
	// static. nodes divides by the ready agents; service weighs by the
	// ready endpoints of match.service on each node, of all of them; pods
	// weighs the same way by the ready pods match.podSelector and
	// match.namespaceSelector choose (counted by the elected agent, which
	// writes the count to status.replicas).
	// +kubebuilder:validation:Required
	Scope Scope `json:"scope,omitempty"`

	// Action is what happens to a packet whose bucket is empty. drop drops
	// it; shadow counts it as would-drop and passes it; pace delays it: the
	// packet gets an earliest departure time (EDT) at which its tokens will
	// have accrued, and the uplink's fq qdisc holds it until then (without
	// fq the time does nothing: see manageQdisc); reject drops it and
	// answers (ingress: see ActionReject). With unit requests, drop
	// refuses a request (or makes it wait: see onEmpty) and shadow admits
	// it, counted as refused.
	// (Optional) drop | shadow | pace | reject; default drop. pace only
	// with match.direction egress and attach uplink; reject only with
	// direction ingress; unit requests only drop or shadow.
	// +kubebuilder:default=drop
	// +optional
	Action Action `json:"action,omitempty"`

	// OnEmpty is, for unit requests, what a request whose bucket is empty
	// does: fail is refused at once (HTTP 429 with Retry-After, gRPC
	// ResourceExhausted with RetryInfo); wait is held until its token
	// accrues, bounded by maxWait and the request's own deadline: a
	// request that could not be served within them fails at once, not
	// after waiting. (The kernel's counterpart of wait is action pace.)
	// (Optional) Only with unit requests; fail | wait; default fail.
	// +optional
	OnEmpty OnEmpty `json:"onEmpty,omitempty"`

	// MaxWait is how long a request may wait with onEmpty wait.
	// (Optional) Only with onEmpty wait; 1ms..1m; default 1s.
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Format=duration
	// +optional
	MaxWait *metav1.Duration `json:"maxWait,omitempty"`

	// Horizon is how long a paced packet may wait: a packet whose
	// departure would be later than this from now is dropped (and counted
	// as a horizon drop), and draws no tokens.
	// (Optional) Only with action pace; 1ms..4s; default 100ms.
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:Format=duration
	// +optional
	Horizon *metav1.Duration `json:"horizon,omitempty"`

	// Share is how the global rate is divided among the nodes. equal:
	// by the count alone (rate / replicas; with scope service, by each
	// node's local endpoints), whatever traffic each node has. demand: by
	// what each node asks for, max-min fair: a node that needs less than
	// an equal share gets what it needs, and the rest goes to the nodes
	// that need more. Each agent measures its node's demand (the admitted
	// and over-limit units it already counts), reports it in a Lease of
	// its own at most once per demandShares.interval when it moved, and
	// the elected agent publishes the allocation in the status
	// (status.allocation); every node also gets a small floor, so that a
	// node whose traffic starts is served at once. Without a fresh
	// allocation (no elected agent, the API server unreachable) the nodes
	// go back to equal shares. See docs/kubernetes.md.
	// With a key, every key is shared out on its own: a node reports the
	// keys that run out of their equal share (at most hotKeys of them),
	// and the allocation gives each reported key its own shares over the
	// nodes (status.allocation.keys); every other key keeps rate /
	// replicas on every node.
	// (Optional) equal | demand; default equal. demand needs scope nodes,
	// service or pods; with a key, it is not allowed with action pace.
	// +kubebuilder:default=equal
	// +optional
	Share Share `json:"share,omitempty"`

	// HotKeys is, for a keyed limit with share demand, how many of its keys
	// each node reports at most (those that ask the most over their equal
	// share) and the allocation holds at most (those asked the most over
	// the nodes). Keys beyond it keep their equal share: rate / replicas
	// on every node.
	// (Optional) Only with share demand and a key; 1..256; default 256.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=256
	// +optional
	HotKeys *int32 `json:"hotKeys,omitempty"`

	// Attach is where the limit is enforced. uplink: on the node's
	// interfaces (the config's interfaces; XDP for ingress, TC for egress),
	// which see traffic to and from the node as it arrives, before any
	// decapsulation or DNAT. endpoints: at the host side of each local
	// endpoint's interface (TC), which sees the traffic into and out of the
	// endpoint after decapsulation and DNAT, same-node clients included.
	// The endpoints are the Service's local endpoints (scope service), the
	// matching pods' addresses (scope pods), else
	// the addresses in the limit's CIDRs on the endpoint's side: dstCIDRs
	// for ingress, srcCIDRs for egress. An endpoint without an interface of
	// its own (a hostNetwork pod) makes the whole limit fall back to the
	// uplink, and status says so. A limit is enforced at exactly one of the
	// two, so no packet is charged twice for it.
	// (Optional) endpoints | uplink; default endpoints with scope service
	// or pods, uplink otherwise.
	// +optional
	Attach Attach `json:"attach,omitempty"`
}

// Match selects packets. Each field narrows the match; an empty list matches
// anything.
//
// +kubebuilder:object:generate=true
// +kubebuilder:validation:XValidation:rule="!has(self.dstPorts) || size(self.dstPorts) == 0 || !has(self.protocol) || self.protocol != 'icmp'",message="dstPorts needs protocol tcp, udp or any: icmp has no ports",fieldPath=".dstPorts"
type Match struct {
	// Direction is which way the packets go, seen from the node (attach
	// uplink) or from the endpoint (attach endpoints): ingress is traffic
	// arriving, egress traffic leaving.
	// (Optional) ingress | egress; default ingress.
	// +kubebuilder:default=ingress
	// +optional
	Direction Direction `json:"direction,omitempty"`

	// Protocol is the L4 protocol (icmp covers ICMP and ICMPv6).
	// (Optional) any | tcp | udp | icmp; default any.
	// +kubebuilder:default=any
	// +optional
	Protocol Protocol `json:"protocol,omitempty"`

	// DstPorts are destination ports, each "53" or an inclusive range
	// "8000-8080". With protocol any they restrict TCP and UDP packets, and
	// other protocols do not match.
	// (Optional) Only with protocol tcp, udp or any. Ports 0..65535.
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:items:MaxLength=11
	// +kubebuilder:validation:items:Pattern=`^[0-9]{1,5}(-[0-9]{1,5})?$`
	// +kubebuilder:validation:items:XValidation:rule="!self.matches('^[0-9]{1,5}(-[0-9]{1,5})?$') || self.split('-').all(p, int(p) <= 65535)",message="ports are 0..65535"
	// +kubebuilder:validation:items:XValidation:rule="!self.matches('^[0-9]{1,5}-[0-9]{1,5}$') || int(self.split('-')[0]) <= int(self.split('-')[1])",message="the first port of a range must not be above the last (8000-8080)"
	// +listType=atomic
	// +optional
	DstPorts []string `json:"dstPorts,omitempty"`

	// SrcCIDRs are source networks, IPv4 or IPv6; a bare address means /32
	// or /128.
	// (Optional)
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:items:MaxLength=49
	// +kubebuilder:validation:items:XValidation:rule="isCIDR(self) || isIP(self)",message="must be an IPv4 or IPv6 network or address, e.g. 10.0.0.0/8, 2001:db8::/32 or 192.0.2.1 (IPv4-mapped IPv6 is written as IPv4)"
	// +listType=atomic
	// +optional
	SrcCIDRs []string `json:"srcCIDRs,omitempty"`

	// DstCIDRs are destination networks, as SrcCIDRs.
	// (Optional)
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:items:MaxLength=49
	// +kubebuilder:validation:items:XValidation:rule="isCIDR(self) || isIP(self)",message="must be an IPv4 or IPv6 network or address, e.g. 10.0.0.0/8, 2001:db8::/32 or 192.0.2.1 (IPv4-mapped IPv6 is written as IPv4)"
	// +listType=atomic
	// +optional
	DstCIDRs []string `json:"dstCIDRs,omitempty"`

	// Service is a Kubernetes Service, "namespace/name"; the watcher fills in
	// its local endpoints.
	// (Optional) Only with scope service, which requires it.
	// +kubebuilder:validation:MaxLength=127
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`
	// +optional
	Service string `json:"service,omitempty"`

	// PodSelector chooses pods by their labels (a standard label selector:
	// matchLabels and matchExpressions; {} is every pod), in the namespaces
	// namespaceSelector chooses, or in every namespace without it. The
	// limit applies at the matching pods' interfaces, and scope pods counts
	// the matching ready pods. Pods with hostNetwork never match: they have
	// no interface of their own.
	// (Optional) Only with scope pods, which requires podSelector or
	// namespaceSelector (or both).
	// +optional
	PodSelector *metav1.LabelSelector `json:"podSelector,omitempty"`

	// NamespaceSelector chooses namespaces by their labels: the pods in them
	// that podSelector chooses (every pod without it) match.
	// (Optional) Only with scope pods.
	// +optional
	NamespaceSelector *metav1.LabelSelector `json:"namespaceSelector,omitempty"`
}

// SelectsPods reports whether the match chooses pods by labels
// (podSelector or namespaceSelector).
func (m *Match) SelectsPods() bool { return m.PodSelector != nil || m.NamespaceSelector != nil }

// PrefixLength is the source prefix length per address family.
//
// +kubebuilder:object:generate=true
type PrefixLength struct {
	// IPv4 is the IPv4 prefix length.
	// (Optional) 1..32; default 24.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=32
	// +optional
	IPv4 uint8 `json:"ipv4,omitempty"`

	// IPv6 is the IPv6 prefix length.
	// (Optional) 1..128; default 64.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=128
	// +optional
	IPv6 uint8 `json:"ipv6,omitempty"`
}

// Unit is what one token is worth.
// +kubebuilder:validation:Enum=packets;bytes;connections;requests
type Unit string

const (
	UnitPackets Unit = "packets"
	UnitBytes   Unit = "bytes"
	// UnitConnections counts TCP SYNs without ACK, RST or FIN.
	UnitConnections Unit = "connections"
	// UnitRequests counts HTTP requests or gRPC calls: enforced in the
	// Service's own processes by the limiter library, never by a node.
	UnitRequests Unit = "requests"
)

// Key is how a limit splits its traffic into buckets.
// +kubebuilder:validation:Enum=none;src-ip;dst-ip;src-prefix;dst-prefix;dst-port;custom
type Key string

const (
	KeyNone      Key = "none"
	KeySrcIP     Key = "src-ip"
	KeyDstIP     Key = "dst-ip"
	KeySrcPrefix Key = "src-prefix"
	KeyDstPrefix Key = "dst-prefix"
	KeyDstPort   Key = "dst-port"
	// KeyCustom (unit requests only) keys a request by what the
	// application's key function returns for it: a header, an API key, a
	// consumer's name.
	KeyCustom Key = "custom"
)

// Scope is how a limit's global rate is divided among replicas.
// +kubebuilder:validation:Enum=static;nodes;service;pods
type Scope string

const (
	// ScopeStatic divides by the count of the config's count source.
	ScopeStatic Scope = "static"
	// ScopeNodes divides by the number of ready agents (Kubernetes).
	ScopeNodes Scope = "nodes"
	// ScopeService weighs by ready local endpoints of match.service
	// (Kubernetes).
	ScopeService Scope = "service"
	// ScopePods weighs by the ready local pods that match.podSelector and
	// match.namespaceSelector choose, of all of them in the cluster
	// (Kubernetes).
	ScopePods Scope = "pods"
)

// Action is what happens to a packet whose bucket is empty.
// +kubebuilder:validation:Enum=drop;shadow;pace;reject
type Action string

const (
	ActionDrop   Action = "drop"
	ActionShadow Action = "shadow" // count as would-drop, pass
	ActionPace   Action = "pace"   // egress: delay with an EDT timestamp
	// ActionReject drops the packet and answers a TCP SYN with a RST, a
	// UDP datagram with an ICMP port unreachable (ingress; within the
	// node's rejectBudget; at attach endpoints, dropped unanswered).
	ActionReject Action = "reject"
)

// OnEmpty is what a request does when its bucket is empty (unit
// requests).
// +kubebuilder:validation:Enum=fail;wait
type OnEmpty string

const (
	// OnEmptyFail refuses the request at once (HTTP 429, gRPC
	// ResourceExhausted).
	OnEmptyFail OnEmpty = "fail"
	// OnEmptyWait holds the request until its token accrues, up to
	// maxWait; one that would wait longer fails at once.
	OnEmptyWait OnEmpty = "wait"
)

// Direction is the hook a limit applies at.
// +kubebuilder:validation:Enum=ingress;egress
type Direction string

const (
	DirectionIngress Direction = "ingress"
	DirectionEgress  Direction = "egress"
)

// Share is how a limit's global rate is divided among the nodes.
// +kubebuilder:validation:Enum=equal;demand
type Share string

const (
	// ShareEqual divides by the count: rate / replicas.
	ShareEqual Share = "equal"
	// ShareDemand divides by the nodes' demands, max-min fair.
	ShareDemand Share = "demand"
)

// Attach is where a limit is enforced.
// +kubebuilder:validation:Enum=endpoints;uplink
type Attach string

const (
	AttachEndpoints Attach = "endpoints"
	AttachUplink    Attach = "uplink"
)

// Protocol selects packets by their L4 protocol.
// +kubebuilder:validation:Enum=any;tcp;udp;icmp
type Protocol string

const (
	ProtocolAny  Protocol = "any"
	ProtocolTCP  Protocol = "tcp"
	ProtocolUDP  Protocol = "udp"
	ProtocolICMP Protocol = "icmp" // ICMP and ICMPv6
)

// The valid values of each enum, in the order error messages list them.
var (
	Units     = []Unit{UnitPackets, UnitBytes, UnitConnections, UnitRequests}
	Keys      = []Key{KeyNone, KeySrcIP, KeyDstIP, KeySrcPrefix, KeyDstPrefix, KeyDstPort, KeyCustom}
	OnEmpties = []OnEmpty{OnEmptyFail, OnEmptyWait}
	// RequestKeys are the keys a limit with unit requests may have.
	RequestKeys = []Key{KeyNone, KeySrcIP, KeySrcPrefix, KeyCustom}
	Attaches    = []Attach{AttachEndpoints, AttachUplink}
	Shares      = []Share{ShareEqual, ShareDemand}
	Fallbacks   = []XDPFallback{XDPFallbackNone, XDPFallbackTC}
	Hooks       = []EndpointHook{EndpointHookHost, EndpointHookPod}
	Checks      = []SourceCheck{SourceCheckCount, SourceCheckDrop}
	Scopes      = []Scope{ScopeStatic, ScopeNodes, ScopeService, ScopePods}
	Actions     = []Action{ActionDrop, ActionShadow, ActionPace, ActionReject}
	Directions  = []Direction{DirectionIngress, DirectionEgress}
	Protocols   = []Protocol{ProtocolAny, ProtocolTCP, ProtocolUDP, ProtocolICMP}
)

// InterfacesAuto is the config's interfaces: auto.
const InterfacesAuto = "auto"

// InterfaceList is the config's interfaces: names, or auto. auto is kept as
// the one-element list [auto] and written as the string auto, so that an
// edited config file keeps it as its author wrote it.
type InterfaceList []string

// Auto reports whether the uplinks are found by the agent (interfaces: auto).
func (l InterfaceList) Auto() bool { return len(l) == 1 && l[0] == InterfacesAuto }

// MarshalJSON writes auto as the string auto, and a list as a list.
func (l InterfaceList) MarshalJSON() ([]byte, error) {
	if l.Auto() {
		return json.Marshal(InterfacesAuto)
	}
	return json.Marshal([]string(l))
}

// UnmarshalJSON reads the string auto or a list of names.
func (l *InterfaceList) UnmarshalJSON(data []byte) error {
	var s string
	if err := json.Unmarshal(data, &s); err == nil {
		if s != InterfacesAuto {
			return fmt.Errorf("interfaces: %q is not %q or a list of interface names", s, InterfacesAuto)
		}
		*l = InterfaceList{InterfacesAuto}
		return nil
	}
	var names []string
	if err := json.Unmarshal(data, &names); err != nil {
		return err
	}
	*l = names
	return nil
}
