package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ConditionHostReady is the condition of an EgressProxyHost: the entry
// answered its last Check and can create instances. Reasons: Reachable,
// or the library's HealthReason (Unreachable, Unauthorized,
// HostKeyUnknown, HostKeyMismatch, Forbidden, PoolNotActive,
// PoolNotFound, CredentialsUnavailable, Unknown); the message is the
// Check's.
const ConditionHostReady = "Ready"

// EgressProxyHostStatus is what the last Check of the entry found.
type EgressProxyHostStatus struct {
	// Conditions: Ready.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// Details are the facts the last Check reported, by the backend's
	// keys; kvm2's: hostname, libvirtVersion, domainType (what Create
	// defines: kvm or qemu), acceleration (kvm or none), poolState,
	// poolFreeGiB, and degraded, poolRefresh or capacity when they apply.
	// +optional
	Details map[string]string `json:"details,omitempty"`
	// Capacity is what the host had room for at the last Check; absent
	// when that Check could not learn it (always when not Ready).
	// +optional
	Capacity *HostCapacity `json:"capacity,omitempty"`
	// LastCheckTime is when the last Check finished.
	// +optional
	LastCheckTime *metav1.Time `json:"lastCheckTime,omitempty"`
}

// HostCapacity is what an entry's host has room for (the library's
// Health.Capacity).
type HostCapacity struct {
	// PoolAvailable is the free space of the storage pool the entry puts
	// the proxies' disks on, in bytes.
	PoolAvailable resource.Quantity `json:"poolAvailable"`
	// MemoryAvailable is the host's memory that new guests can have
	// without swapping (free, buffers and page cache), in bytes.
	MemoryAvailable resource.Quantity `json:"memoryAvailable"`
	// CPUs is the number of the host's logical CPUs, which the guests'
	// vCPUs share.
	CPUs int32 `json:"cpus"`
	// Instances is the number of the operator's proxies on the entry
	// whose VMs run (Running or Provisioning).
	Instances int32 `json:"instances"`
}

// EgressProxyHost is one provider entry (a hypervisor) configured on the
// operator, named after the entry: the leader writes its status from each
// health round's Check, and deletes the object when the entry is no longer
// configured. It has no spec: the entry's configuration is the operator's
// entries file.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,shortName=eph
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`
// +kubebuilder:printcolumn:name="Free",type=string,JSONPath=`.status.capacity.poolAvailable`
// +kubebuilder:printcolumn:name="Proxies",type=integer,JSONPath=`.status.capacity.instances`
// +kubebuilder:printcolumn:name="Memory",type=string,JSONPath=`.status.capacity.memoryAvailable`,priority=1
// +kubebuilder:printcolumn:name="CPUs",type=integer,JSONPath=`.status.capacity.cpus`,priority=1
// +kubebuilder:printcolumn:name="Hostname",type=string,JSONPath=`.status.details.hostname`,priority=1
// +kubebuilder:printcolumn:name="Libvirt",type=string,JSONPath=`.status.details.libvirtVersion`,priority=1
// +kubebuilder:printcolumn:name="Checked",type=date,JSONPath=`.status.lastCheckTime`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type EgressProxyHost struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Status EgressProxyHostStatus `json:"status,omitempty"`
}

// EgressProxyHostList is a list of EgressProxyHost.
// +kubebuilder:object:root=true
type EgressProxyHostList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []EgressProxyHost `json:"items"`
}
