// Independent post-quantum peers for cryptd's interop tests: @noble/post-quantum (ML-DSA,
// ML-KEM) and hpke-js (@hpke/core with @hpke/ml-kem and @hpke/hybridkem-x-wing).
// Reads a JSON array of commands on stdin, writes a JSON array of answers; bytes are hex.
import { ml_dsa44, ml_dsa65, ml_dsa87 } from "@noble/post-quantum/ml-dsa.js";
import { ml_kem768, ml_kem1024 } from "@noble/post-quantum/ml-kem.js";
import { Aes256Gcm, CipherSuite, HkdfSha256 } from "@hpke/core";
import { MlKem768, MlKem1024 } from "@hpke/ml-kem";
import { XWing } from "@hpke/hybridkem-x-wing";

const DSA = { 44: ml_dsa44, 65: ml_dsa65, 87: ml_dsa87 };
const KEM = { 768: ml_kem768, 1024: ml_kem1024 };
const HPKE_KEM = { "ml-kem-768": MlKem768, "ml-kem-1024": MlKem1024, "x25519-ml-kem-768": XWing };

const hex = (bytes) => Buffer.from(bytes).toString("hex");
const bin = (text) => new Uint8Array(Buffer.from(text ?? "", "hex"));

function suite(kem) {
  return new CipherSuite({ kem: new HPKE_KEM[kem](), kdf: new HkdfSha256(), aead: new Aes256Gcm() });
}

async function run(c) {
  switch (c.op) {
    case "mldsa_keygen": {
      const { publicKey } = DSA[c.level].keygen(bin(c.seed));
      return { pk: hex(publicKey) };
    }
    case "mldsa_sign": {
      const { secretKey, publicKey } = DSA[c.level].keygen(bin(c.seed));
      const sig = DSA[c.level].sign(bin(c.msg), secretKey, { context: bin(c.ctx) });
      return { sig: hex(sig), pk: hex(publicKey) };
    }
    case "mldsa_verify":
      return { valid: DSA[c.level].verify(bin(c.sig), bin(c.msg), bin(c.pk), { context: bin(c.ctx) }) };
    case "mlkem_encap": {
      const { cipherText, sharedSecret } = KEM[c.level].encapsulate(bin(c.pk));
      return { ct: hex(cipherText), ss: hex(sharedSecret) };
    }
    case "mlkem_decap": {
      const { secretKey } = KEM[c.level].keygen(bin(c.seed));
      return { ss: hex(KEM[c.level].decapsulate(bin(c.ct), secretKey)) };
    }
    case "hpke_seal": {
      const s = suite(c.kem);
      const recipientPublicKey = await s.kem.deserializePublicKey(bin(c.pk));
      const { ct, enc } = await s.seal({ recipientPublicKey }, bin(c.pt), bin(c.aad));
      return { enc: hex(new Uint8Array(enc)), ct: hex(new Uint8Array(ct)) };
    }
    case "hpke_open": {
      const s = suite(c.kem);
      const recipientKey = await s.kem.deserializePrivateKey(bin(c.sk));
      const pt = await s.open({ recipientKey, enc: bin(c.enc) }, bin(c.ct), bin(c.aad));
      return { pt: hex(new Uint8Array(pt)) };
    }
    case "kem_encap": {
      const s = suite(c.kem);
      const recipientPublicKey = await s.kem.deserializePublicKey(bin(c.pk));
      const { sharedSecret, enc } = await s.kem.encap({ recipientPublicKey });
      return { enc: hex(new Uint8Array(enc)), ss: hex(new Uint8Array(sharedSecret)) };
    }
    case "kem_decap": {
      const s = suite(c.kem);
      const recipientKey = await s.kem.deserializePrivateKey(bin(c.sk));
      return { ss: hex(new Uint8Array(await s.kem.decap({ enc: bin(c.enc), recipientKey }))) };
    }
    default:
      throw new Error(`unknown op ${c.op}`);
  }
}

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const answers = [];
for (const command of JSON.parse(Buffer.concat(chunks).toString("utf8"))) {
  try {
    answers.push(await run(command));
  } catch (error) {
    answers.push({ error: String(error && error.message ? error.message : error) });
  }
}
process.stdout.write(JSON.stringify(answers));
