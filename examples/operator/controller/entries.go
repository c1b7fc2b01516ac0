package controller

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/kvm2"
)

// Keys of an entry's credentials Secret. "ssh-privatekey" is the key of
// Kubernetes' kubernetes.io/ssh-auth Secret type.
const (
	SecretKeySSHPrivateKey = "ssh-privatekey"
	SecretKeyKnownHosts    = "known_hosts"
	SecretKeyPassphrase    = "ssh-passphrase"
)

// EntriesFile is the operator's entry configuration (e.g. a ConfigMap
// mounted as a file): the kvm2 entries (docs/config.md) without
// credentials, and for each entry the Secret its credentials come from:
//
//	credentialsSecrets:
//	  hv1: egressproxy-system/hv1-ssh
//	entries:
//	- {entry: hv1, owner: egressproxy-operator, address: ..., ...}
//
// The client key and known_hosts come from the named Secret's keys
// ssh-privatekey, known_hosts (and optionally ssh-passphrase).
type EntriesFile struct {
	// CredentialsSecrets maps each entry's name to "namespace/name" of
	// the Secret holding its SSH credentials. Every entry needs one.
	CredentialsSecrets map[string]string `json:"credentialsSecrets"`
	Entries            []kvm2.Config     `json:"entries"`
}

// LoadEntries reads an EntriesFile with kvm2.ParseEntries (strictly,
// every problem at once, each naming its key path and line), checks that
// each entry names its credentials Secret, and fills each entry's
// credentials from its Secret, read through r. kvm2.Open validates the
// filled configs (OpenEntries).
func LoadEntries(ctx context.Context, r client.Reader, data []byte) ([]kvm2.Config, error) {
	var f struct { // the file's keys besides entries
		CredentialsSecrets map[string]string `json:"credentialsSecrets"`
	}
	cfgs, err := kvm2.ParseEntries(data, &f)
	problems := []error{err}
	secrets := map[string]types.NamespacedName{}
	for _, entry := range slices.Sorted(maps.Keys(f.CredentialsSecrets)) {
		ns, name, ok := strings.Cut(f.CredentialsSecrets[entry], "/")
		if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
			problems = append(problems, &egressproxy.FieldError{Field: secretKeyPath(entry), Value: f.CredentialsSecrets[entry], Rule: "want namespace/name of a Secret"})
			continue
		}
		secrets[entry] = types.NamespacedName{Namespace: ns, Name: name}
	}
	if err != nil {
		return nil, errors.Join(problems...)
	}
	for i, cfg := range cfgs {
		if _, ok := f.CredentialsSecrets[cfg.Entry]; !ok {
			problems = append(problems, &egressproxy.FieldError{Field: "credentialsSecrets", Rule: fmt.Sprintf("names no Secret for entries[%d] (%s)", i, cfg.Entry)})
		}
	}
	for _, entry := range slices.Sorted(maps.Keys(f.CredentialsSecrets)) {
		if !slices.ContainsFunc(cfgs, func(c kvm2.Config) bool { return c.Entry == entry }) {
			problems = append(problems, &egressproxy.FieldError{Field: secretKeyPath(entry), Rule: "is not the name of an entry"})
		}
	}
	if err := errors.Join(problems...); err != nil {
		return nil, err
	}
	for i := range cfgs {
		cfg := &cfgs[i]
		key := secrets[cfg.Entry]
		var s corev1.Secret
		if err := r.Get(ctx, key, &s); err != nil {
			problems = append(problems, fmt.Errorf("entry %s: read credentials Secret %s: %w", cfg.Entry, key, err))
			continue
		}
		if err := FillCredentials(cfg, &s); err != nil {
			problems = append(problems, fmt.Errorf("entry %s: credentials Secret %s: %w", cfg.Entry, key, err))
		}
	}
	if err := errors.Join(problems...); err != nil {
		return nil, err
	}
	return cfgs, nil
}

// secretKeyPath is the key path of entry's Secret in the file: the entry
// name as it is when it is a plain name, quoted otherwise.
func secretKeyPath(entry string) string {
	if entry != "" && strings.Trim(entry, "abcdefghijklmnopqrstuvwxyz0123456789-") == "" && len(entry) <= 63 {
		return "credentialsSecrets." + entry
	}
	return fmt.Sprintf("credentialsSecrets[%.70q]", entry)
}

// FillCredentials sets cfg's value credentials (Key, KnownHosts,
// KeyPassphrase) from s. Error texts name keys, never values.
func FillCredentials(cfg *kvm2.Config, s *corev1.Secret) error {
	key, kh := s.Data[SecretKeySSHPrivateKey], s.Data[SecretKeyKnownHosts]
	var missing []string
	if len(key) == 0 {
		missing = append(missing, SecretKeySSHPrivateKey)
	}
	if len(kh) == 0 {
		missing = append(missing, SecretKeyKnownHosts)
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing or empty key %s", strings.Join(missing, ", "))
	}
	cfg.Key, cfg.KnownHosts = key, kh
	cfg.KeyPassphrase = s.Data[SecretKeyPassphrase]
	return nil
}

// OpenEntries opens one kvm2 provider per config, each behind an
// egressproxy.Client, with opts (nil valid: kvm2's defaults), whose
// MeterProvider labels each entry's series with its name. On error, the
// ones already opened are closed.
func OpenEntries(ctx context.Context, cfgs []kvm2.Config, opts *kvm2.Options) (map[string]*egressproxy.Client, error) {
	out := map[string]*egressproxy.Client{}
	for _, cfg := range cfgs {
		c, err := kvm2.Open(ctx, cfg, opts)
		if err != nil {
			CloseEntries(out)
			return nil, err
		}
		out[cfg.Entry] = c
	}
	return out, nil
}

// CloseEntries closes every client (it does not delete instances).
func CloseEntries(m map[string]*egressproxy.Client) error {
	var errs []error
	for _, c := range m {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}
