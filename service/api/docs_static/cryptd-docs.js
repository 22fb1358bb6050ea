// cryptd's /docs page: starts Swagger UI and, in development, signs every "Try it out" request
// to /v1/ in the browser (WebCrypto), exactly as docs/AUTH.md and service/auth/signature.py
// define the signature: RFC 9421 hmac-sha256 over "@method" "@path" "@query" "content-digest"
// "content-type", with created, nonce, keyid and alg. The secret becomes a non-extractable
// CryptoKey held in this page's memory only (never in storage) and is sent nowhere.
"use strict";

(() => {
  const config = JSON.parse(document.getElementById("cryptd-docs-config").textContent);
  const encoder = new TextEncoder();
  const COVERED = '("@method" "@path" "@query" "content-digest" "content-type")';
  const CONTENT_TYPE = "application/json";
  const CLIENT_ID = /^[A-Za-z0-9_.-]{1,64}$/;
  let signer = null; // {clientId, key}

  const base64 = (buffer) => {
    const bytes = new Uint8Array(buffer);
    let text = "";
    for (const byte of bytes) text += String.fromCharCode(byte);
    return btoa(text);
  };

  function decodeSecret(text) {
    // Strict base64 (what the server issues): atob alone ignores whitespace and missing padding.
    const value = text.trim();
    if (!/^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/.test(value)) {
      throw new Error("the secret is not base64");
    }
    const bytes = Uint8Array.from(atob(value), (c) => c.charCodeAt(0));
    if (bytes.length < 32) throw new Error("the secret is shorter than 32 bytes");
    return bytes;
  }

  function show(text, ok) {
    const status = document.getElementById("cryptd-signer-status");
    status.textContent = text;
    status.dataset.state = ok ? "signing" : "off";
  }

  async function useCredential(clientId, secretText) {
    if (!window.isSecureContext || !crypto.subtle) {
      throw new Error("WebCrypto needs a secure context: open the page as http://127.0.0.1 " +
        "or http://localhost, or over https");
    }
    if (!CLIENT_ID.test(clientId)) throw new Error("the client id is not valid");
    const secret = decodeSecret(secretText);
    const key = await crypto.subtle.importKey(
      "raw", secret, { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
    secret.fill(0);
    signer = { clientId, key };
    show(`Requests to /v1/ are signed as "${clientId}".`, true);
  }

  function forget() {
    signer = null;
    show("Not signing: requests to /v1/ are refused (401).", false);
  }

  async function loadDevelopmentClient() {
    const answer = await fetch(config.credential, {
      method: "POST",
      credentials: "omit",
      cache: "no-store",
      headers: { "Content-Type": CONTENT_TYPE },
      body: "{}",
    });
    const document_ = await answer.json();
    if (!answer.ok) throw new Error(document_.error ? document_.error.message : answer.statusText);
    await useCredential(document_.client_id, document_.secret);
  }

  function nonce() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return base64(bytes).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function setHeader(headers, name, value) {
    for (const existing of Object.keys(headers)) {
      if (existing.toLowerCase() === name.toLowerCase()) delete headers[existing];
    }
    headers[name] = value;
  }

  // The four headers of one request (docs/AUTH.md, "Signing recipe"). `url` is a URL object,
  // `body` the exact body text, `key` an HMAC CryptoKey. Pure: the known-answer test calls it.
  async function signatureHeaders(method, url, body, clientId, key, created, nonceValue) {
    const bytes = encoder.encode(body);
    const digest = `sha-256=:${base64(await crypto.subtle.digest("SHA-256", bytes))}:`;
    const params = `${COVERED};created=${created};nonce="${nonceValue}";` +
      `keyid="${clientId}";alg="hmac-sha256"`;
    // "@path" as sent (URL keeps it percent-encoded); "@query" is "?" and the query, if any.
    const base = [
      `"@method": ${method}`,
      `"@path": ${url.pathname}`,
      `"@query": ?${url.search.slice(1)}`,
      `"content-digest": ${digest}`,
      `"content-type": ${CONTENT_TYPE}`,
      `"@signature-params": ${params}`,
    ].join("\n");
    const mac = await crypto.subtle.sign("HMAC", key, encoder.encode(base));
    return {
      "Content-Type": CONTENT_TYPE,
      "Content-Digest": digest,
      "Signature-Input": `sig1=${params}`,
      "Signature": `sig1=:${base64(mac)}:`,
    };
  }

  async function sign(request) {
    if (signer === null) return request;
    const url = new URL(request.url, window.location.href);
    if (url.origin !== window.location.origin || !url.pathname.startsWith("/v1/")) return request;
    if (request.body != null && typeof request.body !== "string") {
      throw new Error("cryptd signs JSON bodies only");
    }
    const method = request.method.toUpperCase();
    const headers = await signatureHeaders(
      method, url, request.body == null ? "" : request.body, signer.clientId, signer.key,
      Math.floor(Date.now() / 1000), nonce());
    request.method = method;
    request.headers = request.headers || {};
    for (const [name, value] of Object.entries(headers)) setHeader(request.headers, name, value);
    return request;
  }

  function report(error) {
    show(`Not signing: ${error.message}`, false);
  }

  function wirePanel() {
    const load = document.getElementById("cryptd-signer-load");
    if (config.credential) {
      load.addEventListener("click", () => loadDevelopmentClient().catch(report));
    } else {
      load.hidden = true;
    }
    document.getElementById("cryptd-signer-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const id = document.getElementById("cryptd-signer-id");
      const secret = document.getElementById("cryptd-signer-secret");
      useCredential(id.value.trim(), secret.value).catch(report);
      secret.value = "";
    });
    document.getElementById("cryptd-signer-forget").addEventListener("click", forget);
    forget();
  }

  const options = {
    url: config.openapi,
    dom_id: "#swagger-ui",
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    validatorUrl: null,
    tryItOutEnabled: false,
  };
  if (config.signing) {
    wirePanel();
    options.requestInterceptor = sign;
  } else {
    options.supportedSubmitMethods = []; // no "Try it out": the page cannot sign here
  }
  window.cryptdSignatureHeaders = signatureHeaders; // holds no secret: for the tests
  window.ui = SwaggerUIBundle(options);
})();
