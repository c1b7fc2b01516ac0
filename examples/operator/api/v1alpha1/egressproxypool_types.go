package v1alpha1

import (
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// DefaultUnhealthyGrace is how long a child may stay unhealthy, or on an
// unreachable entry, before the pool counts it as lost when
// EgressProxyPoolSpec.UnhealthyGrace is not set.
const DefaultUnhealthyGrace = 2 * time.Minute

// DefaultDrainPeriod is how long a Healthy child the pool takes out stays
// listed as terminating (serving, not ready) before it is deleted, when
// EgressProxyPoolSpec.DrainPeriod is not set.
const DefaultDrainPeriod = 30 * time.Second

// EgressProxyPoolSpec is the desired pool: how many proxies, made from
// which template, on which entries.
type EgressProxyPoolSpec struct {
	// Replicas is how many proxies (EgressProxy children) the pool runs.
	// +kubebuilder:validation:Minimum=0
	Replicas int32 `json:"replicas"`

	// Template is every child's proxy: an EgressProxy's spec without its
	// entry, which the pool chooses.
	Template ProxyTemplate `json:"template"`

	// Entries are the provider entries the pool may place children on.
	// Empty: every entry configured on the operator. A child on an entry
	// no longer among them is replaced on one that is, successor first.
	// +optional
	Entries PoolEntries `json:"entries,omitempty"`

	// MaxPerEntry is the most children one entry may hold. Zero: no
	// limit.
	// +optional
	// +kubebuilder:validation:Minimum=0
	MaxPerEntry int32 `json:"maxPerEntry,omitempty"`

	// MaxUnavailable is how many children below replicas may be
	// unhealthy while the pool replaces children (after a change of the
	// template or of a Secret's contents it names, past maxAge, or off an
	// entry the pool no longer selects). Zero (the default): none; a
	// replacement is created and Healthy before its predecessor is taken
	// out.
	// +optional
	// +kubebuilder:validation:Minimum=0
	MaxUnavailable int32 `json:"maxUnavailable,omitempty"`

	// MaxSurge is how many children above replicas the pool may hold
	// while it replaces children. Default 1.
	// +optional
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	MaxSurge int32 `json:"maxSurge,omitempty"`

	// UnhealthyGrace is how long a child may stay Unhealthy, or on an
	// entry whose last Check was not Reachable while the child does not
	// pass its probes, before the pool replaces it on another entry.
	// Default 2m.
	// +optional
	UnhealthyGrace *metav1.Duration `json:"unhealthyGrace,omitempty"`

	// MaxAge, when set, makes a child older than it (by its
	// creationTimestamp) outdated, as a template change does: it is
	// replaced, one surge at a time, before it is taken out. Absent: no
	// age limit.
	// +optional
	MaxAge *metav1.Duration `json:"maxAge,omitempty"`

	// DrainPeriod is how long a Healthy child the pool takes out (a
	// predecessor replaced after a template change, a child removed when
	// the pool shrinks or rebalances) stays in the EndpointSlices as
	// terminating (serving, not ready: new clients go elsewhere, open
	// tunnels continue) before it is deleted. Default 30s.
	// +optional
	DrainPeriod *metav1.Duration `json:"drainPeriod,omitempty"`
}

// PoolEntries chooses entries by name, by label, or both: an entry is
// eligible when it is named in Names or its labels (the entries file's
// labels) match Selector. Both empty: every configured entry.
type PoolEntries struct {
	// Names are entry names.
	// +optional
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:items:MaxLength=63
	Names []string `json:"names,omitempty"`
	// Selector selects entries by their labels.
	// +optional
	Selector *metav1.LabelSelector `json:"selector,omitempty"`
}

// Condition types of an EgressProxyPool.
const (
	// ConditionPoolAvailable: at least replicas - maxUnavailable children
	// are Healthy. Reasons: Available, NotEnoughHealthy.
	ConditionPoolAvailable = "Available"
	// ConditionPoolPlaced: every child the pool wants has an entry.
	// Reasons: Placed, Shortfall (the message names each entry that
	// takes no more and why), InvalidEntries (the entry selector is
	// invalid).
	ConditionPoolPlaced = "Placed"
)

// PoolEntryStatus is the pool's children on one entry.
type PoolEntryStatus struct {
	// Name of the entry.
	Name string `json:"name"`
	// Replicas is the number of the pool's children on the entry that
	// are neither being deleted nor drained.
	Replicas int32 `json:"replicas"`
	// Healthy is how many of them are Healthy.
	Healthy int32 `json:"healthy"`
	// Reachable is the entry's last Check's verdict.
	Reachable bool `json:"reachable"`
}

// EgressProxyPoolStatus is what the operator observed of the pool.
type EgressProxyPoolStatus struct {
	// DesiredReplicas is spec.replicas as last reconciled.
	// +optional
	DesiredReplicas int32 `json:"desiredReplicas,omitempty"`
	// CreatedReplicas is the number of children that exist and are
	// neither being deleted nor drained.
	// +optional
	CreatedReplicas int32 `json:"createdReplicas,omitempty"`
	// HealthyReplicas is the number of those children whose health is
	// Healthy: the addresses the pool's EndpointSlices list as ready.
	// +optional
	HealthyReplicas int32 `json:"healthyReplicas,omitempty"`
	// Entries is the children's distribution over the eligible entries
	// (and any other entry that still holds a child), by entry name.
	// +optional
	// +listType=map
	// +listMapKey=name
	Entries []PoolEntryStatus `json:"entries,omitempty"`
	// ServiceName is the selector-less Service in the pool's namespace
	// whose EndpointSlices list the Healthy children.
	// +optional
	ServiceName string `json:"serviceName,omitempty"`
	// ObservedGeneration is the generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// Conditions: Available, Placed.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// EgressProxyPool runs replicas EgressProxy children made from its
// template, spread over the eligible entries, and one Service in front of
// the Healthy ones. It owns its children as a ReplicaSet owns its Pods.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=epp
// +kubebuilder:validation:XValidation:rule="self.metadata.name.size() <= 63 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",message="metadata.name must be a DNS-1035 label (at most 63 characters, a-z, 0-9 and '-', starting with a letter): it is the name of the pool's Service"
// +kubebuilder:printcolumn:name="Desired",type=integer,JSONPath=`.spec.replicas`
// +kubebuilder:printcolumn:name="Created",type=integer,JSONPath=`.status.createdReplicas`
// +kubebuilder:printcolumn:name="Healthy",type=integer,JSONPath=`.status.healthyReplicas`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type EgressProxyPool struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   EgressProxyPoolSpec   `json:"spec,omitempty"`
	Status EgressProxyPoolStatus `json:"status,omitempty"`
}

// EgressProxyPoolList is a list of EgressProxyPool.
// +kubebuilder:object:root=true
type EgressProxyPoolList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []EgressProxyPool `json:"items"`
}
