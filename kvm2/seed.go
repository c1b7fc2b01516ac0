package kvm2

import (
	"bytes"
	"fmt"
	"strings"

	"github.com/kdomanski/iso9660"
	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy/provider"
)

// seedLabel is the volume label cloud-init's NoCloud datasource looks for.
const seedLabel = "cidata"

// seedData is the content of a NoCloud seed.
type seedData struct {
	InstanceID string // meta-data instance-id (the instance UID)
	Hostname   string // meta-data local-hostname (the instance name)
	UserData   string // user-data, verbatim
}

// metaData returns the NoCloud meta-data document (YAML, values quoted by the
// encoder).
func (s seedData) metaData() ([]byte, error) {
	return yaml.Marshal(map[string]string{
		"instance-id":    s.InstanceID,
		"local-hostname": s.Hostname,
	})
}

// buildSeed returns a cloud-init NoCloud seed: an ISO 9660 image labelled
// "cidata" holding the files user-data and meta-data.
func buildSeed(s seedData) ([]byte, error) {
	if len(s.UserData) > provider.MaxUserDataBytes {
		return nil, provider.WithCode(provider.Permanent, fieldErr("UserData", "",
			fmt.Sprintf("is %d bytes, at most %d allowed", len(s.UserData), provider.MaxUserDataBytes)))
	}
	if s.InstanceID == "" {
		return nil, provider.WithCode(provider.Permanent, fieldErr("UID", "", "is required"))
	}
	if s.Hostname == "" {
		return nil, provider.WithCode(provider.Permanent, fieldErr("Name", "", "is required"))
	}
	md, err := s.metaData()
	if err != nil {
		return nil, provider.WithCode(provider.Permanent, fmt.Errorf("encode meta-data: %w", err))
	}
	w, err := iso9660.NewWriter()
	if err != nil {
		return nil, provider.WithCode(provider.Transient, fmt.Errorf("seed ISO: %w", err))
	}
	defer w.Cleanup()
	if err := w.AddFile(strings.NewReader(s.UserData), "user-data"); err != nil {
		return nil, provider.WithCode(provider.Transient, fmt.Errorf("seed ISO: add user-data: %w", err))
	}
	if err := w.AddFile(bytes.NewReader(md), "meta-data"); err != nil {
		return nil, provider.WithCode(provider.Transient, fmt.Errorf("seed ISO: add meta-data: %w", err))
	}
	var buf bytes.Buffer
	if err := w.WriteTo(&buf, seedLabel); err != nil {
		return nil, provider.WithCode(provider.Transient, fmt.Errorf("seed ISO: write: %w", err))
	}
	return buf.Bytes(), nil
}
