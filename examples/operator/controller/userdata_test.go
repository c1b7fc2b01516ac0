package controller

import (
	"strings"
	"testing"

	"github.com/GehirnInc/crypt/sha512_crypt"
	"sigs.k8s.io/yaml"
)

type cloudConfig struct {
	WriteFiles []struct {
		Path        string `json:"path"`
		Owner       string `json:"owner"`
		Permissions string `json:"permissions"`
		Content     string `json:"content"`
	} `json:"write_files"`
}

func parseUserData(t *testing.T, ud string) map[string]string {
	t.Helper()
	if !strings.HasPrefix(ud, "#cloud-config\n") {
		t.Fatalf("user-data does not start with #cloud-config:\n%s", ud)
	}
	var cc cloudConfig
	if err := yaml.UnmarshalStrict([]byte(ud), &cc); err != nil {
		t.Fatalf("user-data is not YAML: %v\n%s", err, ud)
	}
	files := map[string]string{}
	for _, f := range cc.WriteFiles {
		files[f.Path] = f.Content
		if f.Path == "/etc/squid/passwd" && (f.Owner != "root:proxy" || f.Permissions != "0640") {
			t.Errorf("passwd file owner %q permissions %q, want root:proxy 0640 (Squid's helper runs as proxy)", f.Owner, f.Permissions)
		}
	}
	return files
}

func TestUserDataWithCredentials(t *testing.T) {
	creds := Credentials{User: "alice", Password: "s3cret pass'word"}
	salt := SaltFor("uid-1")
	ud, err := UserData(8080, creds, salt)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(ud, creds.Password) {
		t.Fatalf("user-data holds the password in clear:\n%s", ud)
	}
	files := parseUserData(t, ud)
	conf := files["/etc/squid/squid.conf"]
	for _, want := range []string{"http_port 8080\n", "auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid/passwd\n",
		"acl proxyusers proxy_auth REQUIRED\n", "http_access allow CONNECT proxyusers\n", "http_access deny all\n"} {
		if !strings.Contains(conf, want) {
			t.Errorf("squid.conf lacks %q:\n%s", want, conf)
		}
	}
	if strings.Contains(conf, "http_access allow CONNECT\n") {
		t.Errorf("squid.conf allows CONNECT without credentials:\n%s", conf)
	}
	user, hash, ok := strings.Cut(strings.TrimSpace(files["/etc/squid/passwd"]), ":")
	if !ok || user != "alice" || !strings.HasPrefix(hash, "$6$"+salt+"$") {
		t.Fatalf("passwd line %q: want alice:$6$%s$...", files["/etc/squid/passwd"], salt)
	}
	if err := sha512_crypt.New().Verify(hash, []byte(creds.Password)); err != nil {
		t.Errorf("the hash does not verify the password: %v", err)
	}
	if err := sha512_crypt.New().Verify(hash, []byte("wrong")); err == nil {
		t.Error("the hash verifies a wrong password")
	}
	// The same object: the same user-data (a stable spec digest); another
	// password or object: other user-data.
	again, _ := UserData(8080, creds, SaltFor("uid-1"))
	rotated, _ := UserData(8080, Credentials{User: "alice", Password: "other"}, salt)
	otherObj, _ := UserData(8080, creds, SaltFor("uid-2"))
	if again != ud || rotated == ud || otherObj == ud {
		t.Errorf("user-data stable %v, changes with the password %v, with the object %v; want true, true, true", again == ud, rotated != ud, otherObj != ud)
	}
}

func TestUserDataWithoutCredentials(t *testing.T) {
	ud, err := UserData(3128, Credentials{}, SaltFor("uid-1"))
	if err != nil {
		t.Fatal(err)
	}
	files := parseUserData(t, ud)
	if _, ok := files["/etc/squid/passwd"]; ok || len(files) != 1 {
		t.Fatalf("files %v: want squid.conf only", files)
	}
	conf := files["/etc/squid/squid.conf"]
	if !strings.Contains(conf, "http_port 3128\n") || !strings.Contains(conf, "http_access allow CONNECT\n") || strings.Contains(conf, "auth_param") {
		t.Errorf("squid.conf:\n%s", conf)
	}
}

func TestSaltFor(t *testing.T) {
	s := SaltFor("some-uid")
	if len(s) != 16 || strings.Trim(s, saltAlphabet) != "" || s != SaltFor("some-uid") || s == SaltFor("other-uid") {
		t.Fatalf("SaltFor = %q: want 16 stable characters of crypt's alphabet, different per uid", s)
	}
}
