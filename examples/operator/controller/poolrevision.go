package controller

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
)

// LabelPoolRevision is on each of a pool's children: the pool's revision
// (poolRevision) when the child was made, as a ReplicaSet's pods carry
// pod-template-hash. A child whose revision is not the pool's is
// outdated.
const LabelPoolRevision = "egressproxy.dev/pool-revision"

// The keys of the Secrets a child's proxy reads (proxyConfig): a change of
// another key changes no proxy, and so no revision.
var (
	credentialsKeys = []string{"username", "password"}
	tlsKeys         = []string{SecretKeyTLSCert, SecretKeyTLSKey, SecretKeyCA}
)

// poolRevision is the revision of pool's children: a hash over the
// template and the contents of the Secrets it names (the keys a proxy
// reads; a Secret that does not exist counts as such), ten hex digits.
// A new password or certificate changes it as a template change does, so
// the pool replaces its children before it removes them; a Secret
// rewritten with the same data does not. The Secrets' data enters only
// through an HMAC keyed by the Secret's UID, so the revision (a label
// anyone who may read the children can read) is no oracle against which
// to test guessed passwords without the right to read the Secret; a
// Secret deleted and created again with the same data is a new revision.
// A Secret that cannot be read now is an error.
func (r *PoolReconciler) poolRevision(ctx context.Context, pool *v1alpha1.EgressProxyPool) (string, error) {
	t := pool.Spec.Template
	tj, err := json.Marshal(t)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	writeField(h, tj)
	for _, s := range []struct {
		ref  *v1alpha1.SecretReference
		keys []string
	}{{t.CredentialsSecretRef, credentialsKeys}, {t.TLSSecretRef, tlsKeys}} {
		if s.ref == nil {
			writeField(h, nil)
			continue
		}
		var sec corev1.Secret
		key := types.NamespacedName{Namespace: pool.Namespace, Name: s.ref.Name}
		err := r.APIReader.Get(ctx, key, &sec)
		switch {
		case apierrors.IsNotFound(err):
			writeField(h, []byte("absent"))
		case err != nil:
			return "", fmt.Errorf("read Secret %s: %w", key, err)
		default:
			mac := hmac.New(sha256.New, []byte(sec.UID))
			for _, k := range s.keys {
				v, ok := sec.Data[k]
				writeField(mac, []byte(k))
				writeField(mac, []byte(strconv.FormatBool(ok)))
				writeField(mac, v)
			}
			writeField(h, mac.Sum(nil))
		}
	}
	return hex.EncodeToString(h.Sum(nil))[:10], nil
}

// writeField writes b to h after its length, so that no two sequences
// of fields write the same bytes.
func writeField(h hash.Hash, b []byte) {
	h.Write([]byte(strconv.Itoa(len(b)) + ":"))
	h.Write(b)
}
