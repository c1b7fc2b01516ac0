package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

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
// mounted as a file):
//
//	entries:
//	- credentialsSecret: egressproxy-system/hv1-ssh
//	  config: {entry: hv1, owner: egressproxy-operator, address: ..., ...}
//
// config is a kvm2.Config (docs/config.md) without credentials; the client
// key and known_hosts come from the named Secret's keys ssh-privatekey,
// known_hosts (and optionally ssh-passphrase).
type EntriesFile struct {
	Entries []EntryConfig `json:"entries"`
}

// EntryConfig is one entry of EntriesFile.
type EntryConfig struct {
	// CredentialsSecret is "namespace/name" of the Secret holding the SSH
	// credentials.
	CredentialsSecret string      `json:"credentialsSecret"`
	Config            kvm2.Config `json:"config"`
}

// LoadEntries decodes an EntriesFile strictly, each entry's config with
// kvm2.ParseConfig and CredentialsLater (every problem at once, each naming
// its key or field; the credentials come from the Secret),
// and fills each entry's credentials from its Secret, read through r.
// kvm2.Open validates the filled configs again (OpenEntries).
func LoadEntries(ctx context.Context, r client.Reader, data []byte) ([]kvm2.Config, error) {
	var raw struct {
		Entries []struct {
			CredentialsSecret string          `json:"credentialsSecret"`
			Config            json.RawMessage `json:"config"`
		} `json:"entries"`
	}
	if err := yaml.UnmarshalStrict(data, &raw); err != nil {
		return nil, fmt.Errorf("entries: %w", err)
	}
	f := EntriesFile{Entries: make([]EntryConfig, len(raw.Entries))}
	for i, e := range raw.Entries {
		cfg, err := kvm2.ParseConfig(e.Config, kvm2.CredentialsLater())
		if err != nil {
			return nil, fmt.Errorf("entries[%d].config: %w", i, err)
		}
		f.Entries[i] = EntryConfig{CredentialsSecret: e.CredentialsSecret, Config: cfg}
	}
	if len(f.Entries) == 0 {
		return nil, errors.New("entries: none configured")
	}
	seen := map[string]bool{}
	out := make([]kvm2.Config, 0, len(f.Entries))
	for i, e := range f.Entries {
		cfg := e.Config
		if seen[cfg.Entry] {
			return nil, fmt.Errorf("entries[%d]: entry %q given twice", i, cfg.Entry)
		}
		seen[cfg.Entry] = true
		ns, name, ok := strings.Cut(e.CredentialsSecret, "/")
		if !ok || ns == "" || name == "" {
			return nil, fmt.Errorf("entries[%d]: credentialsSecret %q: want namespace/name", i, e.CredentialsSecret)
		}
		var s corev1.Secret
		if err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &s); err != nil {
			return nil, fmt.Errorf("entries[%d] (%s): read credentials Secret %s/%s: %w", i, cfg.Entry, ns, name, err)
		}
		if err := FillCredentials(&cfg, &s); err != nil {
			return nil, fmt.Errorf("entries[%d] (%s): credentials Secret %s/%s: %w", i, cfg.Entry, ns, name, err)
		}
		out = append(out, cfg)
	}
	return out, nil
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
// egressproxy.Client. On error, the ones already opened are closed.
func OpenEntries(ctx context.Context, cfgs []kvm2.Config, log logr.Logger) (map[string]*egressproxy.Client, error) {
	out := map[string]*egressproxy.Client{}
	for _, cfg := range cfgs {
		c, err := kvm2.Open(ctx, cfg, &kvm2.Options{Logger: log})
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
