package provider

import (
	"errors"
	"regexp"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

func validSpec() Spec {
	return Spec{Name: "proxy-1", UID: "0b6f1c3e-7d2a-4c55-9a61-2f9e8d7c6b5a", Port: 3128, ImageKey: "debian-12.1", UserData: "#cloud-config\n"}
}

func TestSpecValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Spec)
		field  string // "" = valid
	}{
		{"valid", func(*Spec) {}, ""},
		{"defaults", func(s *Spec) { s.Port = 0; s.ImageKey = ""; s.UserData = "" }, ""},
		{"max name", func(s *Spec) { s.Name = strings.Repeat("a", 63) }, ""},
		{"name empty", func(s *Spec) { s.Name = "" }, "Name"},
		{"name upper", func(s *Spec) { s.Name = "Proxy" }, "Name"},
		{"name too long", func(s *Spec) { s.Name = strings.Repeat("a", 64) }, "Name"},
		{"name leading dash", func(s *Spec) { s.Name = "-a" }, "Name"},
		{"name trailing dash", func(s *Spec) { s.Name = "a-" }, "Name"},
		{"name double dash", func(s *Spec) { s.Name = "a--b" }, "Name"},
		{"name dot", func(s *Spec) { s.Name = "a.b" }, "Name"},
		{"name slash", func(s *Spec) { s.Name = "a/b" }, "Name"},
		{"name xml", func(s *Spec) { s.Name = "a<b>" }, "Name"},
		{"uid empty", func(s *Spec) { s.UID = "" }, "UID"},
		{"uid too long", func(s *Spec) { s.UID = strings.Repeat("u", 129) }, "UID"},
		{"uid control", func(s *Spec) { s.UID = "a\nb" }, "UID"},
		{"uid bad utf8", func(s *Spec) { s.UID = "a\xffb" }, "UID"},
		{"uid xml and unicode ok", func(s *Spec) { s.UID = `<&"'>ü日本` }, ""},
		{"port negative", func(s *Spec) { s.Port = -1 }, "Port"},
		{"port too big", func(s *Spec) { s.Port = 65536 }, "Port"},
		{"port max", func(s *Spec) { s.Port = 65535 }, ""},
		{"image key upper", func(s *Spec) { s.ImageKey = "Debian" }, "ImageKey"},
		{"image key double dash", func(s *Spec) { s.ImageKey = "a--b" }, "ImageKey"},
		{"image key long", func(s *Spec) { s.ImageKey = strings.Repeat("k", 64) }, "ImageKey"},
		{"image key trailing dot", func(s *Spec) { s.ImageKey = "a." }, "ImageKey"},
		{"machine type bad", func(s *Spec) { s.MachineType = "big_one" }, "MachineType"},
		{"user data max", func(s *Spec) { s.UserData = strings.Repeat("x", MaxUserDataBytes) }, ""},
		{"user data too big", func(s *Spec) { s.UserData = strings.Repeat("x", MaxUserDataBytes+1) }, "UserData"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := validSpec()
			tt.mutate(&s)
			err := s.Validate()
			if tt.field == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() = nil, want error for %s", tt.field)
			}
			if Code(err) != Permanent {
				t.Errorf("Code = %v, want Permanent", Code(err))
			}
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Field != tt.field {
				t.Errorf("error %v does not name field %s", err, tt.field)
			}
			if !strings.Contains(err.Error(), tt.field) {
				t.Errorf("message %q does not name %s", err, tt.field)
			}
		})
	}
}

func TestSpecValidateReportsEveryField(t *testing.T) {
	err := Spec{Port: 70000}.Validate()
	for _, f := range []string{"Name", "UID", "Port"} {
		if !strings.Contains(err.Error(), "invalid "+f) {
			t.Errorf("%q does not mention %s", err, f)
		}
	}
}

// volumeComponent is the rule a name must meet to be embedded in a libvirt
// volume or domain name: no path separators, no XML or shell metacharacters,
// lowercase DNS label.
var volumeComponent = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

func TestPropertyAcceptedNamesAreVolumeComponents(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		name := rapid.OneOf(
			rapid.StringMatching(`[a-z0-9-]{0,70}`),
			rapid.String(),
			rapid.StringMatching(`[a-z0-9][a-z0-9.\-_A-Z]{0,65}`),
		).Draw(t, "name")
		err := ValidateName("Name", name)
		if err == nil {
			if !volumeComponent.MatchString(name) || strings.Contains(name, "--") {
				t.Fatalf("accepted %q, which is not a safe volume-name component", name)
			}
			return
		}
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != "Name" || !strings.Contains(err.Error(), "Name") {
			t.Fatalf("rejection of %q does not name the field: %v", name, err)
		}
	})
}

func TestPropertySpecRejectionsNameAField(t *testing.T) {
	fields := map[string]bool{"Name": true, "UID": true, "Port": true, "ImageKey": true, "MachineType": true, "UserData": true}
	rapid.Check(t, func(t *rapid.T) {
		s := Spec{
			Name:        rapid.StringMatching(`[a-zA-Z0-9.\-]{0,66}`).Draw(t, "name"),
			UID:         rapid.String().Draw(t, "uid"),
			Port:        rapid.IntRange(-10, 70000).Draw(t, "port"),
			ImageKey:    rapid.StringMatching(`[a-z0-9.\-A-Z]{0,66}`).Draw(t, "key"),
			MachineType: rapid.StringMatching(`[a-z0-9.\-_]{0,10}`).Draw(t, "mt"),
			UserData:    strings.Repeat("x", rapid.IntRange(0, MaxUserDataBytes+10).Draw(t, "udlen")),
		}
		err := s.Validate()
		if err == nil {
			if ValidateName("Name", s.Name) != nil || s.UID == "" || s.Port < 0 || s.Port > 65535 || len(s.UserData) > MaxUserDataBytes {
				t.Fatalf("accepted invalid spec %+v", s)
			}
			return
		}
		if Code(err) != Permanent {
			t.Fatalf("Code = %v", Code(err))
		}
		var fe *FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("no FieldError in %v", err)
		}
		for _, line := range strings.Split(err.Error(), "\n") {
			named := false
			for f := range fields {
				if strings.HasPrefix(line, "invalid "+f) {
					named = true
				}
			}
			if !named {
				t.Fatalf("line %q does not name a field", line)
			}
		}
	})
}

func FuzzSpecValidate(f *testing.F) {
	f.Add("proxy-1", "uid", 3128, "debian-12", "#cloud-config")
	f.Add("a--b", "", -1, "K", "")
	f.Add(strings.Repeat("a", 64), "\x00", 65536, "a.", "x")
	f.Fuzz(func(t *testing.T, name, uid string, port int, key, ud string) {
		s := Spec{Name: name, UID: uid, Port: port, ImageKey: key, UserData: ud}
		err := s.Validate()
		if err == nil {
			if !volumeComponent.MatchString(name) {
				t.Fatalf("accepted bad name %q", name)
			}
			return
		}
		if Code(err) != Permanent {
			t.Fatalf("Code = %v", Code(err))
		}
	})
}

func TestInstanceAddress(t *testing.T) {
	if (Instance{}).Address() != "" {
		t.Fatal("empty")
	}
	if got := (Instance{IP: "::1", Port: 3128}).Address(); got != "[::1]:3128" {
		t.Fatal(got)
	}
}
