// Package watcher turns a source of replica counts into observations the
// agent divides limits by.
//
// A Source reports, per limit, the latest Observation: how many replicas
// share the limit (and, for the service scope, how many of them are on this
// node), when that was last confirmed, and the last error reading it. The
// last good observation is state, not a cache entry: an error, a timeout or a
// missing file never resets a count. Only its age grows, and callers report
// that age.
//
// Sources here: Static (a fixed count) and File (one integer in a file,
// polled). Kubernetes is the cluster's source: the RateLimits, the
// EndpointSlices of the Services they reference (and no others), and the
// agents' DaemonSet, whose status.numberReady is the nodes scope's count. It
// asks the API server nothing beyond its watches while they work
// (watchHealth dates the observations from them).
//
// In a cluster the RateLimits' status has one writer: StatusWriter, on the
// agent that holds the Lease rlagent-status, which also allocates the
// demand shares. Every agent writes its own Lease, rlagent-demand-NODE
// (DemandPublisher): its demands and its verdicts on each limit (Reporter),
// which the writer reads into the allocation and the Accepted condition.
// Events are output only: the writer records them for people; nothing
// reads them back.
//
// APIServer is not a count source: it follows the addresses and ports the
// agent's own API server connection carries (the endpoints of the Service
// default/kubernetes, or the kubeconfig's host), which the agent protects
// from every limit.
package watcher
