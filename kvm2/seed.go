package kvm2

import (
	"fmt"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/isoseed"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// seedLabel is the volume label cloud-init's NoCloud datasource looks for.
const seedLabel = "cidata"

// seedData is the content of a NoCloud seed.
type seedData struct {
	InstanceID string    // meta-data instance-id (the instance UID)
	Hostname   string    // meta-data local-hostname (the instance name)
	UserData   string    // user-data, verbatim
	Created    time.Time // recording time of the image (the instance's creation); zero: not specified
}

// metaData returns the NoCloud meta-data document (YAML, values quoted by the
// encoder).
func (s seedData) metaData() ([]byte, error) {
	return yaml.Marshal(map[string]string{
		"instance-id":    s.InstanceID,
		"local-hostname": s.Hostname,
	})
}

// buildSeed returns a cloud-init NoCloud seed: an ISO 9660 image (with Rock
// Ridge names) labelled "cidata" holding the files user-data and meta-data,
// built in memory: no temporary file or directory is made.
func buildSeed(s seedData) ([]byte, error) {
	if len(s.UserData) > naming.MaxUserDataBytes {
		return nil, errs.WithCode(errs.Permanent, fieldErr("UserData", "",
			fmt.Sprintf("is %d bytes, at most %d allowed", len(s.UserData), naming.MaxUserDataBytes)))
	}
	if s.InstanceID == "" {
		return nil, errs.WithCode(errs.Permanent, fieldErr("UID", "", "is required"))
	}
	if s.Hostname == "" {
		return nil, errs.WithCode(errs.Permanent, fieldErr("Name", "", "is required"))
	}
	md, err := s.metaData()
	if err != nil {
		return nil, errs.WithCode(errs.Permanent, fmt.Errorf("encode meta-data: %w", err))
	}
	iso, err := isoseed.Build(isoseed.Volume{Label: seedLabel, Time: s.Created, Files: []isoseed.File{
		{Name: "meta-data", Data: md},
		{Name: "user-data", Data: []byte(s.UserData)},
	}})
	if err != nil {
		// Not reached for input that passed the checks above: the
		// names are fixed and the sizes far below isoseed's limits.
		return nil, errs.WithCode(errs.Permanent, fmt.Errorf("seed ISO: %w", err))
	}
	return iso, nil
}
