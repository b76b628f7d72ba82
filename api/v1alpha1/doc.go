// Package v1alpha1 is the limit spec shared by rlagent's YAML config file and
// the RateLimit custom resource in API group rlagent.io/v1alpha1: the
// Go types, their defaults and their validation.
//
// The types carry JSON field names, so one schema serves the YAML file
// (decoded by this package) and the Kubernetes object. Each field's comment
// says whether it is (Required) or (Optional) and gives its default.
//
// The lifecycle of a config is: decode strictly (unknown fields are errors),
// Default (every default is applied there and nowhere else), Validate (every
// rule, all violations reported at once, each naming the field by its path).
// ParseConfig and LoadConfig do the three steps; WriteConfigAtomic writes a
// config only if it would load.
//
// This package is a leaf: it imports nothing from rlagent. The agent converts
// a validated RateLimitSpec, together with a replica count, into the data
// path's maps.Limit (the node's share of the global rate and burst).
//
// +groupName=rlagent.io
package v1alpha1

// The API group and version of the RateLimit custom resource.
const (
	GroupName = "rlagent.io"
	Version   = "v1alpha1"
)
