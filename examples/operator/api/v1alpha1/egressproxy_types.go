package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// EgressProxySpec is the desired proxy: which provider entry runs it, from
// which image, on which port, with which proxy credentials.
type EgressProxySpec struct {
	// Provider is the name of the provider entry (a kvm2 Config's entry,
	// configured on the operator) that runs the proxy's VM. Changing it
	// moves the proxy: the VM on the old entry is deleted, a new one is
	// created on the new entry.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`
	Provider string `json:"provider"`

	ProxyTemplate `json:",inline"`
}

// ProxyTemplate is what an EgressProxy's proxy is, apart from the entry
// that runs it: an EgressProxy's spec holds it inline, and an
// EgressProxyPool's template gives it to each of the pool's children.
type ProxyTemplate struct {
	// Image is the image key of the entry's configured images
	// (provider.Spec.ImageKey). Empty: the entry's default image.
	// +optional
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$`
	Image string `json:"image,omitempty"`

	// MachineType selects vCPUs and memory from the entry's configured
	// machine types. Empty: the entry's default.
	// +optional
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$`
	MachineType string `json:"machineType,omitempty"`

	// Port is the port the proxy listens on in the VM. Zero: 3128.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=65535
	Port int32 `json:"port,omitempty"`

	// CredentialsSecretRef names a Secret in the object's namespace that
	// holds the proxy's basic-auth credentials under the keys "username"
	// and "password". The VM's cloud-init user-data holds the password's
	// hash only; the operator's health probes send the credentials.
	// Absent: the proxy asks for no credentials (then allowedClients or
	// open is required).
	// +optional
	CredentialsSecretRef *SecretReference `json:"credentialsSecretRef,omitempty"`

	// AllowedClients are the client address ranges the proxy serves, each
	// an address ("192.0.2.7") or a CIDR prefix without host bits
	// ("10.0.0.0/8"); other clients are refused (403). With credentials,
	// a client must be in a range and authenticate. The operator's own
	// probes must come from a range. Empty: any client (then
	// credentialsSecretRef or open is required).
	// +optional
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:items:MaxLength=49
	AllowedClients []string `json:"allowedClients,omitempty"`

	// AllowedDestinations are where the proxy tunnels CONNECT to; any
	// other target is refused (403). Empty: port 443 on any host. The
	// operator's connect target and egress URL must be among them.
	// +optional
	// +kubebuilder:validation:MaxItems=64
	AllowedDestinations []Destination `json:"allowedDestinations,omitempty"`

	// TLSSecretRef names a Secret of type kubernetes.io/tls in the
	// object's namespace: the proxy's port then speaks TLS only (an HTTPS
	// proxy) with tls.crt (its certificate chain) and tls.key. The
	// operator's probes trust the Secret's ca.crt, or tls.crt's own
	// certificates when it has none, and verify the proxy as the first
	// DNS name of its certificate (as its address when it names none).
	// Absent: plain HTTP.
	// +optional
	TLSSecretRef *SecretReference `json:"tlsSecretRef,omitempty"`

	// Open allows a proxy with neither credentials nor allowedClients: it
	// then tunnels, to the allowed destinations, for anyone who reaches
	// its port. It must be false when either is set. False (the default):
	// such an object is refused (Ready False, reason ProxyConfigInvalid).
	// +optional
	Open bool `json:"open,omitempty"`
}

// Destination allows CONNECT to some ports, on some domains or any host.
type Destination struct {
	// Ports are the allowed target ports. Empty: 443.
	// +optional
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:items:Minimum=1
	// +kubebuilder:validation:items:Maximum=65535
	Ports []int32 `json:"ports,omitempty"`
	// Domains restricts the destination to targets named by one of these
	// domains or a name under one ("example.com" allows api.example.com
	// too); a target given as an IP address never matches. Empty: any
	// host.
	// +optional
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:items:MaxLength=253
	Domains []string `json:"domains,omitempty"`
}

// SecretReference names a Secret in the referring object's namespace.
type SecretReference struct {
	// Name of the Secret.
	// +kubebuilder:validation:MinLength=1
	Name string `json:"name"`
}

// Phase is the lifecycle phase of an EgressProxy.
// +kubebuilder:validation:Enum=Pending;Provisioning;Running;Stopped;Failed;Deleting
type Phase string

// Phases.
const (
	// PhasePending: no VM yet (being created, or creation failed; see the
	// Ready condition).
	PhasePending Phase = "Pending"
	// PhaseProvisioning: the VM exists and runs but has no address yet.
	PhaseProvisioning Phase = "Provisioning"
	// PhaseRunning: the VM runs and has an address.
	PhaseRunning Phase = "Running"
	// PhaseStopped: the VM exists but does not run.
	PhaseStopped Phase = "Stopped"
	// PhaseFailed: the backend reports the VM as crashed or broken.
	PhaseFailed Phase = "Failed"
	// PhaseDeleting: the object is being deleted; the VM is being removed.
	PhaseDeleting Phase = "Deleting"
)

// Health is the proxy's health as decided by the operator's health tracker
// (health.Tracker's states).
// +kubebuilder:validation:Enum=Unknown;Healthy;Unhealthy
type Health string

// Health values.
const (
	HealthUnknown   Health = "Unknown"
	HealthHealthy   Health = "Healthy"
	HealthUnhealthy Health = "Unhealthy"
)

// Condition types of an EgressProxy.
const (
	// ConditionReady: the VM exists with the current spec and runs with
	// an address. Reasons: Running, Provisioning, Stopped, Failed (the
	// instance state), or the library's error class of the last failed
	// call (Transient, Permanent, SpecConflict), or UnknownProvider,
	// CredentialsInvalid, ProxyConfigInvalid, or (True) Superseded: a
	// pool's child whose VM runs the spec of an earlier Secret, kept
	// until its pool has replaced it.
	ConditionReady = "Ready"
	// ConditionProviderReachable: the provider entry answered its last
	// Check. Reasons: Reachable, or the library's provider.HealthReason
	// (Unauthorized, HostKeyUnknown, HostKeyMismatch, Forbidden,
	// PoolNotActive, PoolNotFound, Unreachable, CredentialsUnavailable,
	// Unknown).
	ConditionProviderReachable = "ProviderReachable"
	// ConditionHealthy: the proxy passed its last probes. Reasons:
	// Healthy, NoAddress, Pending (not enough probes yet), or the probe
	// failure kind of the last probe (health.Kind, e.g. ProbeRefused,
	// ProbeTimeout, ProbeAuthRequired).
	ConditionHealthy = "Healthy"
)

// EgressProxyStatus is what the operator observed.
type EgressProxyStatus struct {
	// Phase is the VM's lifecycle phase.
	// +optional
	Phase Phase `json:"phase,omitempty"`
	// Address is the proxy's host:port; empty while the VM has none.
	// +optional
	Address string `json:"address,omitempty"`
	// EgressAddress is the address the proxy's traffic leaves from, as
	// the operator's egress URL answered through it; empty until one was
	// learned (or without an egress URL). A change is an event
	// (EgressAddressChanged) of its own.
	// +optional
	EgressAddress string `json:"egressAddress,omitempty"`
	// Health is the health tracker's decision about the proxy.
	// +optional
	Health Health `json:"health,omitempty"`
	// Provider is the entry the VM was created on (so a change of
	// spec.provider can delete the VM on the old entry).
	// +optional
	Provider string `json:"provider,omitempty"`
	// Instance is the instance name on the provider (derived from the
	// namespace and name with provider.NameFromKubernetes).
	// +optional
	Instance string `json:"instance,omitempty"`
	// SpecDigest is the provider.Spec digest of the VM's spec.
	// +optional
	SpecDigest string `json:"specDigest,omitempty"`
	// ObservedGeneration is the generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// Conditions: Ready, ProviderReachable, Healthy.
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// EgressProxy is one egress proxy VM run by the operator on a provider
// entry.
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=ep
// +kubebuilder:printcolumn:name="Provider",type=string,JSONPath=`.spec.provider`
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Address",type=string,JSONPath=`.status.address`
// +kubebuilder:printcolumn:name="Health",type=string,JSONPath=`.status.health`
// +kubebuilder:printcolumn:name="Egress",type=string,JSONPath=`.status.egressAddress`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type EgressProxy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   EgressProxySpec   `json:"spec,omitempty"`
	Status EgressProxyStatus `json:"status,omitempty"`
}

// EgressProxyList is a list of EgressProxy.
// +kubebuilder:object:root=true
type EgressProxyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []EgressProxy `json:"items"`
}
