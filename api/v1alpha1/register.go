// The markers in this comment, above the package clause, are read by
// controller-gen (make generate): the CRD's API group, and no deepcopy
// functions unless a type asks for them (the file's Config types do not).
//
// +groupName=rlagent.io
// +kubebuilder:object:generate=false

package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// SchemeGroupVersion is the API group and version of the RateLimit custom
// resource.
var SchemeGroupVersion = schema.GroupVersion{Group: GroupName, Version: Version}

// RateLimitResource is the RateLimit resource, for dynamic clients and
// informers.
var RateLimitResource = SchemeGroupVersion.WithResource("ratelimits")

var (
	// SchemeBuilder registers the RateLimit types with a scheme.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)
	// AddToScheme adds the RateLimit types to a scheme, for typed clients
	// and decoders.
	AddToScheme = SchemeBuilder.AddToScheme
)

// Kind takes an unqualified kind and returns it qualified by this API group.
func Kind(kind string) schema.GroupKind {
	return SchemeGroupVersion.WithKind(kind).GroupKind()
}

// Resource takes an unqualified resource and returns it qualified by this
// API group.
func Resource(resource string) schema.GroupResource {
	return SchemeGroupVersion.WithResource(resource).GroupResource()
}

func addKnownTypes(scheme *runtime.Scheme) error {
	scheme.AddKnownTypes(SchemeGroupVersion, &RateLimit{}, &RateLimitList{})
	metav1.AddToGroupVersion(scheme, SchemeGroupVersion)
	return nil
}
