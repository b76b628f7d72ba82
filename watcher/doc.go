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
// Static (a fixed count) and File (one integer in a file, polled) live in
// package count, which imports no client-go (the limiter library uses
// them), and are re-exported here. Kubernetes is the cluster's source: the RateLimits, the
// EndpointSlices of the Services they reference (and no others), and the
// agents' DaemonSet, whose status.numberReady is the nodes scope's count. It
// asks the API server nothing beyond its watches while they work
// (watchHealth dates the observations from them).
//
// The package reads; it writes nothing to the cluster. What an agent
// writes there (the RateLimits' status, its node's Lease, Events) is
// cluster/'s, which reads the limits and counts from here.
//
// APIServer is not a count source: it follows the addresses and ports the
// agent's own API server connection carries (the endpoints of the Service
// default/kubernetes, or the kubeconfig's host), which the agent protects
// from every limit.
package watcher
