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
	"k8s.io/apimachinery/pkg/util/validation"
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
// credentials, for each entry the Secret its credentials come from, and
// optionally each entry's labels (which an EgressProxyPool's entry
// selector matches):
//
//	credentialsSecrets:
//	  hv1: egressproxy-system/hv1-ssh
//	labels:
//	  hv1: {zone: a}
//	entries:
//	- {entry: hv1, owner: egressproxy-operator, address: ..., ...}
//
// The client key and known_hosts come from the named Secret's keys
// ssh-privatekey, known_hosts (and optionally ssh-passphrase).
type EntriesFile struct {
	// CredentialsSecrets maps each entry's name to "namespace/name" of
	// the Secret holding its SSH credentials. Every entry needs one.
	CredentialsSecrets map[string]string `json:"credentialsSecrets"`
	// Labels maps an entry's name to its labels (Kubernetes label keys
	// and values). Optional; an entry without labels has none.
	Labels  map[string]map[string]string `json:"labels,omitempty"`
	Entries []kvm2.Config                `json:"entries"`
}

// LoadEntries reads an EntriesFile with kvm2.ParseEntries (strictly,
// every problem at once, each naming its key path and line), checks that
// each entry names its credentials Secret, and fills each entry's
// credentials from its Secret, read through r. kvm2.Open validates the
// filled configs (OpenEntries).
func LoadEntries(ctx context.Context, r client.Reader, data []byte) ([]kvm2.Config, error) {
	cfgs, _, err := LoadEntriesWithLabels(ctx, r, data)
	return cfgs, err
}

// LoadEntriesWithLabels is LoadEntries that also returns the file's
// labels by entry name, each checked as Kubernetes checks a label (a bad
// key or value, or labels of an entry the file does not have, is a
// FieldError naming its key path, labels.hv1.zone).
func LoadEntriesWithLabels(ctx context.Context, r client.Reader, data []byte) ([]kvm2.Config, map[string]map[string]string, error) {
	return loadEntries(ctx, r, data, nil)
}

// loadEntries is LoadEntriesWithLabels for a file that also declares the
// entries named others elsewhere (its memory entries): labels may name
// them too.
func loadEntries(ctx context.Context, r client.Reader, data []byte, others []string) ([]kvm2.Config, map[string]map[string]string, error) {
	var f struct { // the file's keys besides entries
		CredentialsSecrets map[string]string            `json:"credentialsSecrets"`
		Labels             map[string]map[string]string `json:"labels"`
	}
	cfgs, err := kvm2.ParseEntries(data, &f)
	problems := []error{err}
	problems = append(problems, checkLabels(f.Labels)...)
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
		return nil, nil, errors.Join(problems...)
	}
	for i, cfg := range cfgs {
		if _, ok := f.CredentialsSecrets[cfg.Entry]; !ok {
			problems = append(problems, &egressproxy.FieldError{Field: "credentialsSecrets", Rule: fmt.Sprintf("names no Secret for entries[%d] (%s)", i, cfg.Entry)})
		}
	}
	isEntry := func(entry string) bool {
		return slices.ContainsFunc(cfgs, func(c kvm2.Config) bool { return c.Entry == entry })
	}
	for _, entry := range slices.Sorted(maps.Keys(f.CredentialsSecrets)) {
		if !isEntry(entry) {
			problems = append(problems, &egressproxy.FieldError{Field: secretKeyPath(entry), Rule: "is not the name of an entry"})
		}
	}
	for _, entry := range slices.Sorted(maps.Keys(f.Labels)) {
		if !isEntry(entry) && !slices.Contains(others, entry) {
			problems = append(problems, &egressproxy.FieldError{Field: keyPath("labels", entry), Rule: "is not the name of an entry"})
		}
	}
	if err := errors.Join(problems...); err != nil {
		return nil, nil, err
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
		return nil, nil, err
	}
	return cfgs, f.Labels, nil
}

// checkLabels checks each entry's labels as Kubernetes checks an
// object's.
func checkLabels(labels map[string]map[string]string) []error {
	var bad []error
	for _, entry := range slices.Sorted(maps.Keys(labels)) {
		at := keyPath("labels", entry)
		for _, k := range slices.Sorted(maps.Keys(labels[entry])) {
			v := labels[entry][k]
			if msgs := validation.IsQualifiedName(k); len(msgs) > 0 {
				bad = append(bad, &egressproxy.FieldError{Field: keyPath(at, k), Rule: "is not a label key: " + strings.Join(msgs, "; ")})
			}
			if msgs := validation.IsValidLabelValue(v); len(msgs) > 0 {
				bad = append(bad, &egressproxy.FieldError{Field: keyPath(at, k), Value: v, Rule: "is not a label value: " + strings.Join(msgs, "; ")})
			}
		}
	}
	return bad
}

// secretKeyPath is the key path of entry's Secret in the file.
func secretKeyPath(entry string) string { return keyPath("credentialsSecrets", entry) }

// keyPath is the key path of key under parent: the key as it is when it
// is a plain name, quoted otherwise.
func keyPath(parent, key string) string {
	if key != "" && strings.Trim(key, "abcdefghijklmnopqrstuvwxyz0123456789-") == "" && len(key) <= 63 {
		return parent + "." + key
	}
	return fmt.Sprintf("%s[%.70q]", parent, key)
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
