package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The RateLimit custom resource: a limit of the config file as a
// cluster-wide Kubernetes object. Its spec is the file's RateLimitSpec, and
// the kubebuilder markers on the spec types (types.go) make the CRD schema
// (deploy/crd.yaml, written by `make generate`) reject at the API server what
// a schema can express: required fields, enums, bounds, formats and cheap
// cross-field rules. The markers never change how the file is read; the file
// is checked by Validate alone, and so is every RateLimit an agent receives,
// since a schema cannot express every rule (and an object stored under an
// older schema was never checked against the new one).

// ConditionAccepted is the condition type that says whether the agents
// accept a RateLimit: True, or False with the reason and the error as the
// message.
const ConditionAccepted = "Accepted"

// The reasons of the Accepted condition, from the most severe. Invalid and
// Valid are the same on every agent; DoesNotFit, Clamped and
// EnforcedAtUplink are one node's
// (the message starts with "node NAME: "), and an agent does not overwrite
// another node's report with a less severe one, so that the agents' writes
// converge on the worst.
const (
	// ReasonInvalid (False): the agent's validation rejected the spec; the
	// condition's message lists every problem, one per line.
	ReasonInvalid = "Invalid"
	// ReasonDoesNotFit (False): the spec is valid, but a node could not
	// apply the limit (more limits than the data path holds, more prefixes
	// than its tables hold); the other limits are not affected. If an
	// earlier version of the limit was enforced there, it still is, and the
	// message says so.
	ReasonDoesNotFit = "DoesNotFit"
	// ReasonClamped (True): a node enforces the limit with its share
	// clamped to the data path's range.
	ReasonClamped = "Clamped"
	// ReasonEnforcedAtUplink (True): a node enforces a limit meant for its
	// endpoints' interfaces at its uplinks instead, because a local
	// endpoint has no interface of its own (a hostNetwork pod); the
	// message names it. As severe as Clamped: the first reported stays.
	ReasonEnforcedAtUplink = "EnforcedAtUplink"
	// ReasonPaceIneffective (True): a paced limit is enforced, but a
	// node's uplink does not hold its packets to their departure times
	// (its qdisc is not fq): they leave at once, and only the horizon
	// drops. The message names the interface and what it has instead. As
	// severe as Clamped.
	ReasonPaceIneffective = "PaceIneffective"
	// ReasonEnforcedInProcess (True): a valid limit with unit requests:
	// the limiter library enforces it inside the Service's own processes,
	// and no node installs it.
	ReasonEnforcedInProcess = "EnforcedInProcess"
	// ReasonValid (True): the spec passed the agent's validation, and the
	// agents that apply it apply it as written.
	ReasonValid = "Valid"
)

// RateLimit is one global rate limit, enforced on every node of the cluster
// by the rlagent DaemonSet. The object's name is the limit's name.
//
// It is cluster-scoped: a limit acts on the nodes' host packet path, which
// every namespace shares. A namespaced RateLimit would let a tenant with
// rights in one namespace limit the traffic of every other tenant.
//
// +genclient
// +genclient:nonNamespaced
// +kubebuilder:object:generate=true
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,path=ratelimits,singular=ratelimit,shortName=rl
// +kubebuilder:subresource:status
// +kubebuilder:printcolumn:name="Rate",type=integer,JSONPath=".spec.rate",description="The global rate, in units per second over all replicas"
// +kubebuilder:printcolumn:name="Unit",type=string,JSONPath=".spec.unit",description="What one token is worth"
// +kubebuilder:printcolumn:name="Scope",type=string,JSONPath=".spec.scope",description="How the global rate is divided among replicas"
// +kubebuilder:printcolumn:name="Replicas",type=integer,JSONPath=".status.replicas",description="The count the global rate is divided by, as the agents observe it"
// +kubebuilder:printcolumn:name="Accepted",type=string,JSONPath=".status.conditions[?(@.type==\"Accepted\")].status",description="Whether the agents accept the spec"
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=".metadata.creationTimestamp"
// +kubebuilder:validation:XValidation:rule="size(self.metadata.name) <= 63 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",message="metadata.name is the limit's name: 1..63 lowercase letters, digits and '-', starting and ending with a letter or digit (no dots)"
type RateLimit struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// Spec is the limit: the global rate, which packets it applies to, how
	// it splits them into buckets, how the rate is divided among replicas
	// and what happens to a packet over the limit.
	// (Required)
	// +required
	Spec RateLimitSpec `json:"spec"`

	// Status is what the agents observe: the replica count the rate is
	// divided by, and whether they accept the spec.
	// +optional
	Status RateLimitStatus `json:"status,omitzero"`
}

// RateLimitStatus is written by the agents, through the status subresource.
//
// +kubebuilder:object:generate=true
type RateLimitStatus struct {
	// ObservedGeneration is the metadata.generation of the spec this status
	// describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// Replicas is the count the global rate is divided by, as the agents
	// observe it: the ready agents with scope nodes, the ready endpoints of
	// the Service with scope service, the matching ready pods with scope
	// pods (counted by the elected agent alone: the agents divide by this
	// number). A count below 1 is enforced as 1.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=2147483647
	// +optional
	Replicas int32 `json:"replicas"`

	// Allocation is the last allocation of a limit with share demand, as
	// the elected agent published it; absent for share equal.
	// +optional
	Allocation *Allocation `json:"allocation,omitempty"`

	// Conditions are the observations of the limit's state. Type Accepted
	// is True when the agents accept the spec (reason Valid, or Clamped when
	// a node enforces it clamped to the data path's range), and False when
	// they do not: reason Invalid with their validation error as the message
	// (no agent enforces it), or DoesNotFit when a node could not apply it
	// (the message names the node and says why).
	// +listType=map
	// +listMapKey=type
	// +patchStrategy=merge
	// +patchMergeKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty" patchStrategy:"merge" patchMergeKey:"type"`
}

// Allocation is one round of a demand-shared limit's allocation: two
// numbers, whatever the number of nodes. A node whose reported demand is d
// enforces max(floor, min(d, water)), the smaller of this round's share and
// the last round's (an increase waits one round, until every node has
// applied the round that made room for it).
//
// Every number has the bounds of its Go type in the schema: the agents
// decode RateLimits with a typed client, a list at a time, and one value
// out of range would stop every agent's updates.
//
// +kubebuilder:object:generate=true
type Allocation struct {
	// Round counts the allocations published; a node steps its share once
	// per round.
	Round int64 `json:"round"`

	// Water is the most a node gets, units/s; absent when every node gets
	// all it asks for (the demands fit the rate).
	// +kubebuilder:validation:Minimum=0
	// +optional
	Water *uint64 `json:"water,omitempty"`

	// Floor is the least a node gets, units/s, asked for or not.
	// +kubebuilder:validation:Minimum=0
	Floor uint64 `json:"floor"`

	// Nodes is how many nodes' reports the round counted, and Demand what
	// they asked for together, units/s.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=2147483647
	Nodes int32 `json:"nodes"`
	// +kubebuilder:validation:Minimum=0
	Demand uint64 `json:"demand"`

	// Time is when the round was computed (to the microsecond, as the
	// demand Leases' times). Its age says whether it still counts
	// (demandShares.staleAfter); a report counts in it if it was written
	// at least half an interval before.
	Time metav1.MicroTime `json:"time"`

	// Keys are, for a keyed limit, the keys the nodes reported as hot,
	// each with its own allocation (floor is every key's floor): at most
	// spec.hotKeys, those asked for the most, sorted by key. A key not
	// listed has its equal share, rate / replicas, on every node. For a
	// keyed limit, water is absent and nodes and demand count the reports
	// and what their keys asked for together.
	// +kubebuilder:validation:MaxItems=256
	// +listType=map
	// +listMapKey=key
	// +optional
	Keys []KeyAllocation `json:"keys,omitempty"`
}

// KeyAllocation is one key's allocation in a round of a keyed limit: a
// node that reported the key enforces max(floor, min(its demand, water)) for
// it, the others the floor.
//
// +kubebuilder:object:generate=true
type KeyAllocation struct {
	// Key is the key as the nodes report it: an address (src-ip, dst-ip),
	// a network (src-prefix, dst-prefix: 10.1.2.0/24), or a protocol and
	// port (dst-port: tcp/443, udp/53; a packet without ports: tcp/0,
	// udp/0, icmp/0, any/0).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=64
	Key string `json:"key"`

	// Water is the most a node gets of the key, units/s; absent when every
	// node that reported it gets all it asks for.
	// +kubebuilder:validation:Minimum=0
	// +optional
	Water *uint64 `json:"water,omitempty"`

	// Nodes is how many nodes' reports of the key the round counted.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=2147483647
	Nodes int32 `json:"nodes"`
}

// RateLimitList is a list of RateLimits.
//
// +kubebuilder:object:generate=true
// +kubebuilder:object:root=true
type RateLimitList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []RateLimit `json:"items"`
}
