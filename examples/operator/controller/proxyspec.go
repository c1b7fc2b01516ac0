package controller

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/guest"
)

// The keys of a kubernetes.io/tls Secret the operator reads.
const (
	SecretKeyTLSCert = corev1.TLSCertKey       // "tls.crt"
	SecretKeyTLSKey  = corev1.TLSPrivateKeyKey // "tls.key"
	SecretKeyCA      = "ca.crt"
)

// proxyConfig is what the reconciler derives from an object besides the
// Spec's plain fields: the VM's user-data, and how the health probes
// reach the proxy.
type proxyConfig struct {
	userData string
	creds    Credentials
	probeTLS *tls.Config // nil: plain HTTP
}

// invalid is a Permanent problem of the object: the Ready condition's
// reason and the message.
type invalid struct {
	reason string
	err    error
}

func (e *invalid) Error() string { return e.err.Error() }
func (e *invalid) Unwrap() error { return e.err }

func invalidf(reason, format string, args ...any) error {
	return &invalid{reason: reason, err: driver.Errorf(egressproxy.Permanent, format, args...)}
}

// ProxyDescription is the guest description of an object's proxy
// (package guest): its port, the credentials, client ranges and
// destinations of its spec, and TLS when t is not nil.
func ProxyDescription(spec v1alpha1.EgressProxySpec, creds Credentials, t *guest.TLS) guest.Config {
	c := guest.Config{Port: int(spec.Port), AllowedClients: spec.AllowedClients, TLS: t, Open: spec.Open}
	if c.Port == 0 {
		c.Port = egressproxy.DefaultPort
	}
	if creds.User != "" {
		c.Users = []guest.User{{Name: creds.User, Password: creds.Password}}
	}
	for _, d := range spec.AllowedDestinations {
		gd := guest.Destination{Domains: d.Domains}
		for _, p := range d.Ports {
			gd.Ports = append(gd.Ports, int(p))
		}
		c.AllowedDestinations = append(c.AllowedDestinations, gd)
	}
	return c
}

// proxyConfig reads the object's Secrets and renders its user-data: the
// description's rules (closed by default) apply, and the same object gets
// the same user-data at every reconcile (the salt of the password hash is
// its UID), while a new password, certificate or rule changes it (and so
// recreates the VM). A Secret that cannot be read now is Transient; what
// the object says wrong is an *invalid.
func (r *Reconciler) proxyConfig(ctx context.Context, ep *v1alpha1.EgressProxy) (proxyConfig, error) {
	var pc proxyConfig
	if ref := ep.Spec.CredentialsSecretRef; ref != nil {
		s, err := r.secret(ctx, ep.Namespace, ref.Name, "proxy credentials", ReasonCredentialsInvalid)
		if err != nil {
			return pc, err
		}
		pc.creds = Credentials{User: string(s.Data["username"]), Password: string(s.Data["password"])}
		if err := pc.creds.validate(); err != nil {
			return pc, invalidf(ReasonCredentialsInvalid, "proxy credentials Secret %s/%s: %v", ep.Namespace, ref.Name, err)
		}
	}
	restricted := pc.creds.User != "" || len(ep.Spec.AllowedClients) > 0
	switch {
	case !restricted && !ep.Spec.Open:
		return pc, invalidf(ReasonProxyConfigInvalid, "the proxy would tunnel for anyone who reaches its port: set credentialsSecretRef or allowedClients, or open: true to mean it")
	case restricted && ep.Spec.Open:
		return pc, invalidf(ReasonProxyConfigInvalid, "spec.open must be false when credentialsSecretRef or allowedClients restrict the proxy")
	}
	var gt *guest.TLS
	if ref := ep.Spec.TLSSecretRef; ref != nil {
		s, err := r.secret(ctx, ep.Namespace, ref.Name, "TLS", ReasonProxyConfigInvalid)
		if err != nil {
			return pc, err
		}
		gt = &guest.TLS{Certificate: string(s.Data[SecretKeyTLSCert]), Key: string(s.Data[SecretKeyTLSKey])}
		pc.probeTLS = probeTLS(s.Data[SecretKeyTLSCert], s.Data[SecretKeyCA])
	}
	ud, err := guest.UserData(ProxyDescription(ep.Spec, pc.creds, gt), &guest.UserDataOptions{Salt: string(ep.UID)})
	if err != nil {
		var lines []string
		for _, fe := range egressproxy.FieldErrors(err) {
			fe.Field = specField(fe.Field)
			lines = append(lines, fe.Error())
		}
		if len(lines) == 0 {
			lines = []string{err.Error()}
		}
		return pc, invalidf(ReasonProxyConfigInvalid, "%s", strings.Join(lines, "; "))
	}
	pc.userData = ud
	return pc, nil
}

// secret reads a Secret of the object's namespace straight from the
// apiserver; a missing one is an *invalid of reason.
func (r *Reconciler) secret(ctx context.Context, ns, name, what, reason string) (*corev1.Secret, error) {
	var s corev1.Secret
	key := types.NamespacedName{Namespace: ns, Name: name}
	if err := r.APIReader.Get(ctx, key, &s); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, invalidf(reason, "%s Secret %s not found", what, key)
		}
		return nil, driver.Errorf(egressproxy.Transient, "read %s Secret %s: %w", what, key, err)
	}
	return &s, nil
}

// specField names a guest.Config field as the object names it.
var specField = strings.NewReplacer(
	"AllowedClients", "spec.allowedClients",
	"AllowedDestinations", "spec.allowedDestinations",
	".Ports", ".ports", ".Domains", ".domains",
	"Users[0].Name", `credentials Secret key "username"`,
	"Users[0].Password", `credentials Secret key "password"`,
	"TLS.Certificate", `TLS Secret key "tls.crt"`,
	"TLS.Key", `TLS Secret key "tls.key"`,
	"Users", "spec.credentialsSecretRef",
	"Port", "spec.port",
	"Open", "spec.open",
).Replace

// probeTLS is the TLS configuration of the operator's probes of a proxy
// serving certPEM: trusting caPEM, or certPEM's own certificates without
// one, and verifying the first DNS name of the certificate (its address
// when it names none).
func probeTLS(certPEM, caPEM []byte) *tls.Config {
	roots := x509.NewCertPool()
	if len(caPEM) > 0 {
		roots.AppendCertsFromPEM(caPEM)
	} else {
		roots.AppendCertsFromPEM(certPEM)
	}
	cfg := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	if b, _ := pem.Decode(certPEM); b != nil {
		if leaf, err := x509.ParseCertificate(b.Bytes); err == nil && len(leaf.DNSNames) > 0 {
			cfg.ServerName = leaf.DNSNames[0]
		}
	}
	return cfg
}

// reasonOf is the Ready reason of a Permanent error of proxyConfig.
func reasonOf(err error) string {
	var inv *invalid
	if errors.As(err, &inv) {
		return inv.reason
	}
	return ReasonCredentialsInvalid
}
